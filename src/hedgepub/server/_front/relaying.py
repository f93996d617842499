"""How the one-port front relays a gRPC connection to the gRPC face: on the server's event loop
(:class:`LoopRelay`), or by handing its socket to the relay process (:class:`RelayProcess`, whose program
is :mod:`hedgepub.server._front.relay`). Which one, and when, is the front's decision
(:class:`~hedgepub.server._front.front.OnePortFront`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["RELAY_CHUNK", "RETRY", "LoopRelay", "RelayProcess"]

#: Largest chunk relayed at once. Not more: glibc serves allocations from 128 KiB up with mmap, and a
#: recv() of 256 KiB measured three times the cost of one of 64 KiB for the same 12 KB request.
RELAY_CHUNK = 64 * 1024
#: A non-blocking socket call that would block, or was interrupted: try again when the socket is ready.
RETRY = (BlockingIOError, InterruptedError)


class LoopRelay:
    """Both directions of one gRPC connection relayed on the event loop: the public socket and the one to
    the gRPC face. It is in ``relays`` (the front's, closed on stop) from its start until it closes."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        client: socket.socket,
        upstream: socket.socket,
        relays: set[LoopRelay],
    ) -> None:
        self._loop = loop
        self._client = client
        self._upstream = upstream
        self._relays = relays
        self._closed = False
        relays.add(self)
        loop.add_reader(client.fileno(), self._forward, client, upstream)
        loop.add_reader(upstream.fileno(), self._forward, upstream, client)

    def _forward(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            data = source.recv(RELAY_CHUNK)
        except RETRY:
            return
        except OSError:
            self.close()
            return
        if not data:
            # HTTP/2 does not half-close a connection: either side's end ends both.
            self.close()
            return
        try:
            sent = sink.send(data)
        except RETRY:
            sent = 0
        except OSError:
            self.close()
            return
        if sent < len(data):
            # The sink is full: stop reading the source until the rest is written.
            self._loop.remove_reader(source.fileno())
            self._loop.add_writer(sink.fileno(), self._drain, source, sink, memoryview(data)[sent:])

    def _drain(self, source: socket.socket, sink: socket.socket, rest: memoryview) -> None:
        try:
            sent = sink.send(rest)
        except RETRY:
            return
        except OSError:
            self.close()
            return
        self._loop.remove_writer(sink.fileno())
        if sent < len(rest):
            self._loop.add_writer(sink.fileno(), self._drain, source, sink, rest[sent:])
        else:
            self._loop.add_reader(source.fileno(), self._forward, source, sink)

    def close(self) -> None:
        """Close both sockets (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._relays.discard(self)
        for sock in (self._client, self._upstream):
            with contextlib.suppress(ValueError, OSError):  # fileno() is -1 once a socket is closed
                self._loop.remove_reader(sock.fileno())
                self._loop.remove_writer(sock.fileno())
            sock.close()


class RelayProcess:
    """The child process that relays gRPC connections (see :mod:`hedgepub.server._front.relay`)."""

    def __init__(self, cpu: int | str | None = None) -> None:
        self.started = time.monotonic()
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    "-S",
                    str(Path(__file__).with_name("relay.py")),
                    str(child.fileno()),
                    *(() if cpu is None else (str(cpu),)),
                ],
                pass_fds=[child.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # it writes nothing there; a reader of the server's waits for EOF
                start_new_session=True,
            )
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        parent.setblocking(False)
        self._control = parent

    def watch(self, loop: asyncio.AbstractEventLoop, on_death: Callable[[], None]) -> None:
        """Call ``on_death`` once the process is gone: its end of the control socket closes then."""

        def readable() -> None:
            try:
                data = self._control.recv(1)
            except RETRY:
                return
            except OSError:
                data = b""
            if not data:
                with contextlib.suppress(ValueError, OSError):
                    loop.remove_reader(self._control.fileno())
                on_death()

        loop.add_reader(self._control.fileno(), readable)

    def hand_over(self, client: socket.socket, target: str, name: str) -> None:
        """Give ``client`` to the process, to relay to the abstract unix name ``target`` from ``name``.

        Raises OSError when the process cannot take it (it died, or is too far behind to read).
        """
        socket.send_fds(self._control, [f"{target}\0{name}".encode()], [client.fileno()])
        client.close()

    async def stop(self) -> None:
        """Close the control socket, which ends the process; wait for it."""
        with contextlib.suppress(ValueError, OSError):
            asyncio.get_running_loop().remove_reader(self._control.fileno())
        self._control.close()
        for _ in range(200):
            if self.process.poll() is not None:
                return
            await asyncio.sleep(0.01)
        self.process.kill()
        self.process.wait()
