"""One port for gRPC and REST: a front listener that tells HTTP/2 from HTTP/1.1 by a connection's first bytes.

``grpc.aio`` speaks only HTTP/2, so the server's gRPC face listens privately (on 127.0.0.1, an ephemeral
port that nobody is told about) and the front owns the public port:

- a connection that opens with the HTTP/2 preface (``PRI * HTTP/2.0``) is relayed, byte for byte, to the
  private gRPC port (gRPC clients, including ``PUBSUB_EMULATOR_HOST`` ones, never notice);
- any other connection is HTTP/1.1, handed to aiohttp's low-level HTTP server, whose handler is the
  :class:`~hedgepub.server._rest.RestGateway`.

The relay is two asyncio protocols writing into each other's transports, with flow control passed
across (a full write buffer on one side pauses reading on the other). It runs on the server's own
event loop: no thread, no lock, and one callback per chunk read (up to 256 KiB).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("hedgepub.server")

#: How every HTTP/2 connection begins (RFC 9113, section 3.4); HTTP/1.1 requests begin with a method.
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
#: Bytes that tell the two apart: no HTTP/1.1 method starts with "PRI".
_SNIFF_BYTES = 3


class _Relay(asyncio.Protocol):
    """One direction's reader: what arrives on its transport is written to the partner transport."""

    def __init__(
        self,
        partner: asyncio.Transport,
        connections: set[asyncio.BaseTransport],
        transport: asyncio.Transport | None = None,
    ) -> None:
        self.partner = partner
        #: Set here for a transport that changes protocol, by connection_made for a new one.
        self.transport = transport
        self._connections = connections

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._connections.add(transport)

    def data_received(self, data: bytes) -> None:
        self.partner.write(data)

    def eof_received(self) -> bool:
        # gRPC does not half-close a connection: either side's end ends both (after what is buffered).
        self.partner.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is not None:
            self._connections.discard(self.transport)
        if exc is None:
            self.partner.close()
        else:
            self.partner.abort()

    def pause_writing(self) -> None:
        # Our transport cannot take more: stop reading what would be written to it.
        self.partner.pause_reading()

    def resume_writing(self) -> None:
        self.partner.resume_reading()


class _Sniffer(asyncio.Protocol):
    """A new public connection, until its first bytes say whether it is gRPC or REST."""

    def __init__(self, front: OnePortFront) -> None:
        self._front = front
        self._transport: asyncio.Transport | None = None
        self._received = b""
        self._decided = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._front.connections.add(transport)

    def data_received(self, data: bytes) -> None:
        assert self._transport is not None
        self._received += data
        if len(self._received) < _SNIFF_BYTES and HTTP2_PREFACE.startswith(self._received):
            return  # too few bytes yet to tell
        self._decided = True
        transport, received = self._transport, self._received
        if received.startswith(HTTP2_PREFACE[:_SNIFF_BYTES]):
            transport.pause_reading()
            task = asyncio.ensure_future(self._front.relay_to_grpc(transport, received))
            self._front.tasks.add(task)
            task.add_done_callback(self._front.tasks.discard)
        else:
            self._front.connections.discard(transport)
            self._front.serve_http(transport, received)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._transport is not None and not self._decided:
            self._front.connections.discard(self._transport)


class OnePortFront:
    """The public listener: gRPC connections relayed to the private gRPC port, HTTP/1.1 served here.

    :meth:`bind` takes the port, :meth:`serve` starts accepting once the gRPC face is up; the
    ``http_protocol_factory`` given to it makes the protocol that serves one HTTP/1.1 connection.
    """

    def __init__(self) -> None:
        self._grpc_host = ""
        self._grpc_port = 0
        self._http_protocol_factory: Callable[[], Any] | None = None
        self._server: asyncio.AbstractServer | None = None
        #: Open public and relay transports, closed on stop.
        self.connections: set[asyncio.BaseTransport] = set()
        self.tasks: set[asyncio.Future[None]] = set()
        self.port = 0

    async def bind(self, host: str, port: int) -> int:
        """Take ``host:port`` (0: any free port), not accepting yet; return the port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Sniffer(self), host, port, reuse_port=False, start_serving=False
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def serve(self, grpc_host: str, grpc_port: int, http_protocol_factory: Callable[[], Any]) -> None:
        """Start accepting: gRPC goes to ``grpc_host:grpc_port``, HTTP/1.1 to ``http_protocol_factory()``."""
        assert self._server is not None, "bind() first"
        self._grpc_host, self._grpc_port = grpc_host, grpc_port
        self._http_protocol_factory = http_protocol_factory
        await self._server.start_serving()

    async def relay_to_grpc(self, client: asyncio.Transport, received: bytes) -> None:
        """Connect to the private gRPC port and relay ``client`` to it both ways."""
        loop = asyncio.get_running_loop()
        try:
            upstream, _ = await loop.create_connection(
                lambda: _Relay(client, self.connections), self._grpc_host, self._grpc_port
            )
        except OSError as error:
            logger.warning("cannot reach the gRPC face on port %d: %s", self._grpc_port, error)
            client.abort()
            return
        if client.is_closing():
            upstream.close()
            return
        sock = upstream.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        assert isinstance(upstream, asyncio.Transport)
        upstream.write(received)
        client.set_protocol(_Relay(upstream, self.connections, client))
        client.resume_reading()

    def serve_http(self, transport: asyncio.Transport, received: bytes) -> None:
        """Hand an HTTP/1.1 connection, and what it sent so far, to the HTTP protocol."""
        assert self._http_protocol_factory is not None
        protocol = self._http_protocol_factory()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        protocol.data_received(received)

    def close(self) -> None:
        """Stop accepting connections."""
        if self._server is not None:
            self._server.close()

    async def stop(self) -> None:
        """Stop accepting, then close every relayed connection still open."""
        self.close()
        for task in list(self.tasks):
            task.cancel()
        for transport in list(self.connections):
            transport.close()
        self.connections.clear()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
