"""The one-port front's relay process: gRPC connections relayed in the kernel, off the server's interpreter.

The server's Python thread is what limits its throughput, so relaying gRPC's bytes on it (as
the front's event-loop relay does) takes from every call. On Linux the front instead
hands each gRPC connection's socket, once told apart from HTTP/1.1, to this process (``SCM_RIGHTS``
over a private socket pair). Here each direction of a connection is one thread moving bytes with
``splice(2)`` through a pipe: the bytes never enter user space, and a thread spends its life blocked in
the kernel with the GIL released, so a relayed chunk costs two system calls and no event-loop turn.

The process runs this file alone (``python -I -S _relay_process.py FD``, standard library only, no
package import), so it starts in tens of milliseconds and holds a few MiB. It lives as long as its
control socket: when the server closes it, or dies, the process exits and the kernel closes what it
relayed (whose gRPC side the server has closed by then anyway).

Control messages, one per connection (``SOCK_SEQPACKET``): the client socket as the one descriptor, and as
data the gRPC face's abstract unix name and the name to bind the relayed connection to, NUL-separated.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import sys
import threading

#: Bytes a relayed direction may hold in its pipe (and move per splice call).
PIPE_BYTES = 256 * 1024
#: Stack of a relaying thread: it runs a few frames deep, and there are two per connection.
THREAD_STACK_BYTES = 256 * 1024
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
#: Largest control message: two socket names (at most 108 bytes each) and a separator.
_CONTROL_BYTES = 512


class _Connection:
    """Both directions of one relayed connection; the last direction to end closes both sockets."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.sockets = (client, upstream)
        self._running = 2
        self._lock = threading.Lock()

    def start(self) -> None:
        client, upstream = self.sockets
        for source, sink in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        read_end, write_end = os.pipe()
        try:
            with contextlib.suppress(OSError):  # a smaller pipe works too, only with more calls
                fcntl.fcntl(write_end, _F_SETPIPE_SZ, PIPE_BYTES)
            relay(source.fileno(), sink.fileno(), read_end, write_end)
        except OSError:
            pass  # a reset connection ends the relay like a closed one
        finally:
            os.close(read_end)
            os.close(write_end)
            # HTTP/2 does not half-close: either side's end ends both, and wakes the other direction.
            for sock in self.sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._running -= 1
                last = self._running == 0
            if last:
                for sock in self.sockets:
                    sock.close()


def relay(source: int, sink: int, read_end: int, write_end: int) -> None:
    """Move bytes from ``source`` to ``sink`` through the pipe until ``source`` ends."""
    while True:
        moved = os.splice(source, write_end, PIPE_BYTES)
        if moved == 0:
            return
        while moved:
            moved -= os.splice(read_end, sink, moved)


def serve(control: socket.socket) -> None:
    """Relay every connection the control socket hands over, until it closes."""
    while True:
        try:
            data, descriptors, _, _ = socket.recv_fds(control, _CONTROL_BYTES, 1)
        except OSError:
            return
        if not data:
            return  # the server closed the control socket, or died
        if not descriptors:
            continue
        client = socket.socket(fileno=descriptors[0])
        client.setblocking(True)
        target, _, name = data.decode("utf-8", "replace").partition("\0")
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if name:
                upstream.bind("\0" + name)
            upstream.connect("\0" + target)
        except OSError as error:
            print(f"hedgepub relay: cannot reach the gRPC face: {error}", file=sys.stderr, flush=True)
            upstream.close()
            client.close()
            continue
        _Connection(client, upstream).start()


def main(argv: list[str]) -> int:
    """Entry point: ``_relay_process.py CONTROL_FD``."""
    # Ctrl-C on a terminal reaches the whole process group; this process ends when the server closes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.stack_size(THREAD_STACK_BYTES)
    serve(socket.socket(fileno=int(argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
