"""One port for gRPC and REST: a front listener that tells HTTP/2 from HTTP/1.1 by a connection's first bytes.

``grpc.aio`` speaks only HTTP/2, so with REST on the server's gRPC face listens privately (a Linux
abstract unix socket, or an ephemeral port of 127.0.0.1 elsewhere, that nobody is told about) and the
front owns the public port. It accepts each connection itself and peeks at its first bytes without
consuming them:

- a connection that opens with the HTTP/2 preface (``PRI * HTTP/2.0``) is relayed, byte for byte, to the
  gRPC face (gRPC clients, including ``PUBSUB_EMULATOR_HOST`` ones, never notice);
- any other connection is HTTP/1.1, handed whole to aiohttp's low-level HTTP server, whose handler is
  the :class:`~hedgepub.server._api.rest.RestGateway`.

The server's one Python thread is what limits its throughput, so where it can (Linux) the front does not
relay gRPC's bytes itself: it hands each gRPC connection's socket to a small relay process
(:mod:`hedgepub.server._front.relay`) that moves them with ``splice(2)``, in the kernel, on the other
core. That process starts in its own session, so that a scheduler that shares CPU between sessions
(Linux's autogroups) does not make it queue behind the server's busy thread. Elsewhere, or when the
process cannot be started, or with ``ServerOptions(relay="loop")``, the server's event loop
relays them (:class:`~hedgepub.server._front.relaying.LoopRelay`): one callback per chunk and
direction, on the raw sockets rather than through asyncio's transports, whose extra layers cost
measurably more. The figures of both are in the README ("REST front cost"); ``rest=False`` avoids the
relay altogether. A relay process that dies is started again (at most once per
:data:`RELAY_RESTART_SECONDS`); meanwhile the event loop relays.

The front defends itself against clients that hold connections without using them: a connection that
has not yet sent enough bytes to tell it apart costs nothing while it waits (where the socket option
``SO_RCVLOWAT`` works, the event loop is only woken when more bytes arrive, never polled) and is closed
after :data:`SNIFF_TIMEOUT_SECONDS`; out of descriptors, the front stops accepting for a moment (the
connections wait in the listen backlog) instead of retrying at once, and says so in the log at most once
per :data:`ACCEPT_ERROR_LOG_SECONDS`.

On a TLS port the first bytes are encrypted, but a TLS client's first message, its ClientHello, is not,
and it names the application protocols the client can speak (ALPN). The front peeks at the whole
ClientHello (:mod:`hedgepub.server._front.client_hello`) and decides by the rule of
:func:`~hedgepub.server._front.client_hello.wants_grpc`: ``h2`` (or ``grpc-exp``) offered without
``http/1.1`` is a gRPC client, whose encrypted bytes are relayed unchanged, as above, to a gRPC face
that holds the server's certificate and ends TLS itself; anything else (``http/1.1`` offered, or no
ALPN) is HTTP/1.1, whose TLS the front ends in Python before aiohttp serves it. A connection whose
first bytes cannot begin a TLS handshake is closed, after a ``400`` answer when they look like a
plain-text HTTP request.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import secrets
import socket
import ssl
import sys
import time
import urllib.parse
from collections.abc import Callable
from typing import Any, Literal

from hedgepub.server._front.client_hello import MAX_PEEK_BYTES, NotClientHello, read_client_hello, wants_grpc
from hedgepub.server._front.relaying import RETRY, LoopRelay, RelayProcess

logger = logging.getLogger("hedgepub.server")

#: How every HTTP/2 connection begins (RFC 9113, section 3.4); HTTP/1.1 requests begin with a method.
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
#: Bytes that tell the two apart: no HTTP/1.1 method starts with "PRI".
_SNIFF_BYTES = 3
#: How long a connection may take to send its first bytes (its whole ClientHello, on a TLS port) before it
#: is closed; on a TLS port, its REST connections get as long again to finish the handshake.
SNIFF_TIMEOUT_SECONDS = 10.0
#: Where SO_RCVLOWAT cannot be relied on, how soon a connection that sent too little to tell is looked at
#: again (first, and at most: each look doubles it).
RESNIFF_FIRST_SECONDS = 0.005
RESNIFF_MAX_SECONDS = 0.5
#: Accepting paused after running out of descriptors (or memory): first pause, and longest.
ACCEPT_PAUSE_FIRST_SECONDS = 0.05
ACCEPT_PAUSE_MAX_SECONDS = 1.0
#: A failure to accept is logged at most once per this many seconds (with how many there were).
ACCEPT_ERROR_LOG_SECONDS = 10.0
#: A relay process that died is started again at most once per this many seconds.
RELAY_RESTART_SECONDS = 1.0
#: Whether the kernel wakes a reader only once SO_RCVLOWAT bytes are in (Linux does, for TCP and unix
#: sockets, since 2.6.28); elsewhere the front looks again after a growing pause.
_RCVLOWAT_WORKS = sys.platform.startswith("linux") and hasattr(socket, "SO_RCVLOWAT")
#: accept() errors that mean "no resources now": pause instead of spinning on a listener that stays ready.
_ACCEPT_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: What a plain-text HTTP request to a TLS port is answered with before the connection is closed.
PLAIN_TEXT_ON_TLS_ANSWER = (
    b"HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n"
    b"This port speaks TLS: use https://.\n"
)
#: Listen backlog of the public socket.
BACKLOG = 128

#: Where a new connection goes: relayed to the gRPC face, served as HTTP/1.1, or closed.
_Way = Literal["grpc", "http", "refuse"]
#: How the front may relay gRPC connections: by the relay process where it runs (else on the event loop),
#: or on the server's event loop always.
RELAYS = ("process", "loop")

#: The front's connections to the gRPC face (a Linux abstract unix socket) are bound to a name that
#: starts with this and carries the client's address, so that the gRPC face's ``context.peer()`` still
#: names the real client (see :func:`client_peer`).
RELAYED_PEER_PREFIX = "hedgepub-front/"
#: Metadata the REST gateway adds to the gRPC call it makes for a REST call: the HTTP client's address.
REST_CLIENT_METADATA = "x-hedgepub-rest-client"
_RELAYED_PEER = "unix-abstract:" + RELAYED_PEER_PREFIX


def peer_name(address: Any) -> str:
    """A socket's remote address in gRPC's peer form: ``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``."""
    if isinstance(address, tuple) and len(address) >= 2:
        host, port = address[0], address[1]
        return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"
    return str(address)


def client_peer(peer: str) -> str:
    """The real client of a gRPC call: ``peer`` itself, or the client a relayed connection came from."""
    if peer.startswith(_RELAYED_PEER):
        # gRPC percent-encodes the socket name; the last part only keeps names unique.
        return urllib.parse.unquote(peer[len(_RELAYED_PEER) :]).rsplit("/", 1)[0]
    return peer


class OnePortFront:
    """The public listener: gRPC connections relayed to the gRPC face, HTTP/1.1 ones served here.

    :meth:`bind` takes the port, :meth:`serve` starts accepting once the gRPC face is up. With ``tls``
    (the server's certificate and key, ALPN ``http/1.1``) the port speaks TLS: gRPC connections are
    relayed still encrypted, to a gRPC face that ends TLS itself, and HTTP/1.1 ones are served over
    ``tls``.

    ``relay`` is ``"process"`` (the relay process where it can run, kept to CPU ``relay_cpu``: see
    :class:`~hedgepub.server.ServerOptions`) or ``"loop"`` (the event loop relays).
    """

    def __init__(
        self, tls: ssl.SSLContext | None = None, *, relay: str = "process", relay_cpu: int | str | None = None
    ) -> None:
        if relay not in RELAYS:
            raise ValueError(f"relay must be one of {', '.join(RELAYS)}; got {relay!r}")
        self._tls = tls
        self._relay = relay
        self._relay_cpu = relay_cpu
        self._listeners: list[socket.socket] = []
        self._grpc_family: int = socket.AF_INET
        self._grpc_address: Any = None
        self._http_protocol_factory: Callable[[], Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Connections being relayed, and those not yet told apart (with their timeout), closed on stop.
        self.relays: set[LoopRelay] = set()
        self._sniffing: dict[socket.socket, asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Future[Any]] = set()
        self._relay_process: RelayProcess | None = None
        self._relay_wanted = False
        self._relay_last_start = -RELAY_RESTART_SECONDS
        #: Accepting: paused after running out of descriptors, and the failures not yet logged.
        self._accept_pause = 0.0
        self._accept_paused = False
        self._accept_errors = 0
        self._accept_error_logged = -ACCEPT_ERROR_LOG_SECONDS
        self._accept_error_last: OSError | None = None
        #: Where SO_RCVLOWAT is not used: each waiting connection's next pause.
        self._resniff_pause: dict[socket.socket, float] = {}
        self.port = 0

    async def bind(self, host: str, port: int) -> int:
        """Take ``host:port`` (0: any free port) on every address ``host`` stands for; return the port."""
        self._loop = asyncio.get_running_loop()
        infos = await self._loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        try:
            for family, kind, protocol, _, address in dict.fromkeys(infos):
                listener = socket.socket(family, kind, protocol)
                self._listeners.append(listener)
                if hasattr(socket, "SO_REUSEADDR") and not _is_windows():
                    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                    listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                if self.port:  # port 0: every address gets the port the first one was given
                    address = (address[0], self.port, *address[2:])
                listener.bind(address)
                listener.listen(BACKLOG)
                listener.setblocking(False)
                self.port = self.port or listener.getsockname()[1]
        except OSError:
            self._close_listeners()
            raise
        return self.port

    async def serve(
        self, grpc_family: int, grpc_address: Any, http_protocol_factory: Callable[[], Any]
    ) -> None:
        """Start accepting: gRPC goes to ``grpc_address`` (of ``grpc_family``), HTTP/1.1 to the factory's
        protocols (one per connection)."""
        assert self._loop is not None, "bind() first"
        self._grpc_family, self._grpc_address = grpc_family, grpc_address
        self._http_protocol_factory = http_protocol_factory
        if (
            hasattr(os, "splice")
            and hasattr(socket, "send_fds")
            and isinstance(grpc_address, str)
            and grpc_address.startswith("\0")
            and self._relay == "process"
        ):
            self._relay_wanted = True
            self._start_relay_process()
        self._watch_listeners()

    def _start_relay_process(self) -> None:
        assert self._loop is not None
        self._relay_last_start = time.monotonic()
        try:
            process = RelayProcess(self._relay_cpu)
        except OSError as error:
            logger.warning("relaying gRPC on the event loop: cannot start the relay process: %s", error)
            return
        self._relay_process = process
        process.watch(self._loop, lambda: self._relay_died(process))

    def _relay_died(self, process: RelayProcess) -> None:
        """The relay process ended (killed, crashed): relay on the event loop until another is started."""
        if self._relay_process is not process:
            return
        logger.warning(
            "relaying gRPC on the event loop for now: the relay process is gone (exit status %s)",
            process.process.poll(),
        )
        self._relay_process = None
        self._spawn(process.stop())
        if self._relay_wanted and self._loop is not None:
            wait = max(0.0, self._relay_last_start + RELAY_RESTART_SECONDS - time.monotonic())
            self._loop.call_later(wait, self._restart_relay_process)

    def _restart_relay_process(self) -> None:
        if self._relay_wanted and self._relay_process is None and self._listeners:
            self._start_relay_process()
            if self._relay_process is not None:
                logger.warning("the relay process was started again; it relays new gRPC connections")

    def _watch_listeners(self) -> None:
        assert self._loop is not None
        self._accept_paused = False
        for listener in self._listeners:
            self._loop.add_reader(listener.fileno(), self._accept, listener)

    def _pause_accepting(self, error: OSError) -> None:
        """Out of descriptors: accept() fails at once while the listener stays ready, so trying again now
        would spin. Stop watching the listeners for a while (doubling while it lasts); clients wait in the
        listen backlog meanwhile. Logged at most once per ACCEPT_ERROR_LOG_SECONDS."""
        assert self._loop is not None
        self._accept_errors += 1
        self._accept_error_last = error
        self._log_accept_errors()
        if self._accept_paused:
            return
        self._accept_paused = True
        for listener in self._listeners:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(listener.fileno())
        self._accept_pause = min(
            ACCEPT_PAUSE_MAX_SECONDS, max(ACCEPT_PAUSE_FIRST_SECONDS, self._accept_pause * 2)
        )
        self._loop.call_later(self._accept_pause, self._resume_accepting)

    def _resume_accepting(self) -> None:
        if self._accept_paused and self._listeners:
            self._watch_listeners()

    def _log_accept_errors(self) -> None:
        now = time.monotonic()
        if self._accept_errors and now - self._accept_error_logged >= ACCEPT_ERROR_LOG_SECONDS:
            logger.warning(
                "accepting connections failed %d time(s) in the last %g s (%s); pausing accepts meanwhile",
                self._accept_errors,
                ACCEPT_ERROR_LOG_SECONDS,
                self._accept_error_last,
            )
            self._accept_error_logged = now
            self._accept_errors = 0

    def _accept(self, listener: socket.socket) -> None:
        assert self._loop is not None
        for _ in range(BACKLOG):
            try:
                connection, _ = listener.accept()
            except RETRY:
                return
            except OSError as error:
                if error.errno in _ACCEPT_EXHAUSTED:
                    self._pause_accepting(error)
                elif error.errno not in (errno.ECONNABORTED, errno.EPROTO):
                    self._accept_errors += 1
                    self._accept_error_last = error
                    self._log_accept_errors()
                return
            self._accept_pause = 0.0
            connection.setblocking(False)
            if connection.family in (socket.AF_INET, socket.AF_INET6):
                connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sniffing[connection] = self._loop.call_later(
                SNIFF_TIMEOUT_SECONDS, self._forget, connection
            )
            self._loop.add_reader(connection.fileno(), self._sniff, connection)

    def _sniff(self, connection: socket.socket) -> None:
        assert self._loop is not None
        try:
            head = connection.recv(MAX_PEEK_BYTES if self._tls else _SNIFF_BYTES, socket.MSG_PEEK)
        except RETRY:
            return
        except OSError:
            head = b""
        if not head:  # closed before it said anything
            self._forget(connection)
            return
        way = self._tell_tls(head) if self._tls is not None else self._tell_plain(head)
        if way is None:
            if self._tls is not None and len(head) >= MAX_PEEK_BYTES:
                self._forget(connection)  # a ClientHello in records too small to fit what is peeked
                return
            # Too few bytes yet to tell, and peeking left them unread, so the socket stays readable. Park
            # it: the kernel wakes the loop only once one more byte is in (or the client closes).
            if self._park(connection, len(head) + 1):
                return
            # Without SO_RCVLOWAT: look again after a pause that grows, rather than spin.
            self._loop.remove_reader(connection.fileno())
            pause = self._resniff_pause.get(connection, RESNIFF_FIRST_SECONDS)
            self._resniff_pause[connection] = min(RESNIFF_MAX_SECONDS, pause * 2)
            self._loop.call_later(pause, self._resniff, connection)
            return
        self._loop.remove_reader(connection.fileno())
        self._sniffing.pop(connection).cancel()
        self._resniff_pause.pop(connection, None)
        self._park(connection, 1)  # back to the default before anything else reads the socket
        if way == "grpc":
            self._spawn(self._relay_to_grpc(connection))
        elif way == "http":
            self._spawn(self._serve_http(connection))
        else:
            _refuse(connection, head)

    @staticmethod
    def _tell_plain(head: bytes) -> _Way | None:
        """Where a plain-text connection goes by its first bytes (None: not known yet)."""
        if len(head) < _SNIFF_BYTES and HTTP2_PREFACE.startswith(head):
            return None
        return "grpc" if head == HTTP2_PREFACE[:_SNIFF_BYTES] else "http"

    @staticmethod
    def _tell_tls(head: bytes) -> _Way | None:
        """Where a connection to a TLS port goes by its ClientHello (None: not all of it is in yet)."""
        try:
            hello = read_client_hello(head)
        except NotClientHello as error:
            logger.debug("closing a connection to the TLS port: %s", error)
            return "refuse"
        if hello is None:
            return None
        return "grpc" if wants_grpc(hello) else "http"

    @staticmethod
    def _park(connection: socket.socket, wanted: int) -> bool:
        """Have the socket report readable only once ``wanted`` bytes are in; False where that cannot be."""
        if not _RCVLOWAT_WORKS:
            return False
        try:
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, wanted)
        except OSError:
            return False
        return True

    def _resniff(self, connection: socket.socket) -> None:
        if connection in self._sniffing and self._loop is not None:
            self._loop.add_reader(connection.fileno(), self._sniff, connection)

    def _forget(self, connection: socket.socket) -> None:
        self._resniff_pause.pop(connection, None)
        timeout = self._sniffing.pop(connection, None)
        if timeout is not None:
            timeout.cancel()
        if self._loop is not None:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(connection.fileno())
        connection.close()

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _relay_to_grpc(self, client: socket.socket) -> None:
        assert self._loop is not None
        # Where the gRPC face is an abstract unix name, the relayed connection is bound to one too: it
        # costs nothing and tells the gRPC face who the client is (see client_peer).
        name = None
        if isinstance(self._grpc_address, str) and self._grpc_address.startswith("\0"):
            name = f"{RELAYED_PEER_PREFIX}{peer_name(client.getpeername())}/{secrets.token_hex(4)}"
        if self._relay_process is not None and name is not None:
            try:
                self._relay_process.hand_over(client, self._grpc_address[1:], name)
                return
            except BlockingIOError:
                pass  # the process is behind: this one connection is relayed here
            except OSError as error:
                # Gone before its death was noticed: relay this one here, and start another process.
                logger.debug("the relay process did not take a connection: %s", error)
                self._relay_died(self._relay_process)
        upstream = socket.socket(self._grpc_family, socket.SOCK_STREAM)
        upstream.setblocking(False)
        try:
            if name is not None:
                upstream.bind("\0" + name)
            await self._loop.sock_connect(upstream, self._grpc_address)
        except OSError as error:
            logger.warning("cannot reach the gRPC face at %r: %s", self._grpc_address, error)
            upstream.close()
            client.close()
            return
        if upstream.family in (socket.AF_INET, socket.AF_INET6):
            upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        LoopRelay(self._loop, client, upstream, self.relays)

    async def _serve_http(self, connection: socket.socket) -> None:
        assert self._loop is not None and self._http_protocol_factory is not None
        try:
            if self._tls is None:
                await self._loop.connect_accepted_socket(self._http_protocol_factory, connection)
            else:
                await self._loop.connect_accepted_socket(
                    self._http_protocol_factory,
                    connection,
                    ssl=self._tls,
                    ssl_handshake_timeout=SNIFF_TIMEOUT_SECONDS,
                )
        except OSError as error:  # ssl.SSLError too: a failed handshake is the client's to report
            if self._tls is not None:
                logger.debug("TLS handshake of a REST connection failed: %s", error)
            connection.close()

    def _close_listeners(self) -> None:
        for listener in self._listeners:
            if self._loop is not None:
                with contextlib.suppress(ValueError, OSError):
                    self._loop.remove_reader(listener.fileno())
            listener.close()
        self._listeners = []

    def close(self) -> None:
        """Stop accepting connections (those open go on)."""
        self._close_listeners()

    async def stop(self) -> None:
        """Stop accepting, then close every connection relayed or still being told apart."""
        self._relay_wanted = False
        self._close_listeners()
        for task in list(self._tasks):
            task.cancel()
        for relay in list(self.relays):
            relay.close()
        for connection in list(self._sniffing):
            self._forget(connection)
        relay_process, self._relay_process = self._relay_process, None
        if relay_process is not None:
            await relay_process.stop()


def _refuse(connection: socket.socket, head: bytes) -> None:
    """Close a connection to a TLS port that did not open with a ClientHello; first answer ``400`` if it
    looks like a plain-text HTTP request (Go's servers do the same), so that its client learns why."""
    with contextlib.suppress(OSError):
        # Read what was peeked: closing a socket with unread bytes resets it, and the reset could overtake
        # the answer.
        connection.recv(len(head))
        if head[:1].isalpha():  # a method (GET, PUT, ...), or HTTP/2's PRI; a TLS record starts with 22
            connection.send(PLAIN_TEXT_ON_TLS_ANSWER)
        connection.shutdown(socket.SHUT_WR)
    connection.close()


def _is_windows() -> bool:
    return sys.platform == "win32"
