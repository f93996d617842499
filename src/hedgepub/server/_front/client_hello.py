"""The ALPN protocols a TLS client offers, read from its ClientHello before anyone answers it.

On a TLS port the one-port front cannot read a request's first bytes to tell gRPC from HTTP/1.1: they
are encrypted. What the client sends first, its ClientHello, is not, and it lists the application
protocols the client can speak (ALPN, RFC 7301). :func:`read_client_hello` parses the bytes peeked from
a new connection, checking every length against what is there, and :func:`wants_grpc` applies the rule
the front routes by.

The layout (RFC 8446, section 4.1.2; RFC 5246, section 7.4.1.2 for TLS 1.2, the same bytes)::

    record:     content type 22 (handshake), legacy version (3, x), length (2 bytes, at most 2^14)
    handshake:  type 1 (client_hello), length (3 bytes)
    body:       legacy version (2), random (32), session id (1-byte length, at most 32),
                cipher suites (2-byte length, even, not 0), compression methods (1-byte length, not 0),
                extensions (2-byte length; absent in some TLS 1.2 hellos): type (2), length (2), data
    ALPN (extension 16): protocol name list (2-byte length, not 0), each name: 1-byte length (not 0)

A handshake message may be split over several records; the fragments are put back together.
"""

from __future__ import annotations

from dataclasses import dataclass

#: TLS record content type of handshake messages.
HANDSHAKE_RECORD = 22
#: Handshake message type of a ClientHello.
CLIENT_HELLO = 1
#: Extension type of ALPN (RFC 7301).
ALPN_EXTENSION = 16
#: Largest record payload a client may send (RFC 8446, section 5.1: 2^14 bytes of plain text).
MAX_RECORD_BYTES = 2**14
#: Largest ClientHello read. Real ones are well under 2 KiB (a few KiB with post-quantum key shares);
#: this bounds what a connection can make the front hold and parse.
MAX_CLIENT_HELLO_BYTES = 64 * 1024
_RECORD_HEADER_BYTES = 5
_HANDSHAKE_HEADER_BYTES = 4
#: Most bytes the front peeks for a ClientHello: the largest one in full-size records, with their headers.
#: One cut into smaller records that does not fit in this is refused.
MAX_PEEK_BYTES = (
    MAX_CLIENT_HELLO_BYTES
    + _HANDSHAKE_HEADER_BYTES
    + _RECORD_HEADER_BYTES * (1 + (MAX_CLIENT_HELLO_BYTES + _HANDSHAKE_HEADER_BYTES) // MAX_RECORD_BYTES)
)

#: ALPN names of HTTP/2, of gRPC's experimental name for itself, and of HTTP/1.1.
H2, GRPC_EXP, HTTP_1_1 = b"h2", b"grpc-exp", b"http/1.1"


class NotClientHello(ValueError):
    """The bytes are not (the beginning of) a well-formed TLS ClientHello."""


@dataclass(frozen=True)
class ClientHello:
    """What the front needs of a ClientHello."""

    #: The ALPN protocol names offered, in the client's order; ``None`` when it sent no ALPN extension.
    alpn: tuple[bytes, ...] | None


def looks_like_tls(head: bytes) -> bool:
    """Whether ``head`` (a connection's first bytes, at least one) can begin a TLS handshake record."""
    return head[:1] == bytes([HANDSHAKE_RECORD]) and (len(head) < 2 or head[1] == 3)


def read_client_hello(data: bytes) -> ClientHello | None:
    """The ClientHello at the start of ``data``; ``None`` while more bytes are needed to read all of it.

    Raises :class:`NotClientHello` when ``data`` cannot begin one (another record type or handshake
    message, a length that does not fit, a ClientHello over ``MAX_CLIENT_HELLO_BYTES``). Bytes after
    the ClientHello's records are not looked at.
    """
    message = _handshake_message(data)
    if message is None:
        return None
    return ClientHello(alpn=_alpn(_Reader(message)))


def wants_grpc(hello: ClientHello) -> bool:
    """Whether the connection goes to the gRPC face: the client offers ``h2`` (or ``grpc-exp``) and not
    ``http/1.1``, as gRPC clients do; REST clients offer ``http/1.1`` (curl, browsers and Go also offer
    ``h2``), or no ALPN at all."""
    offered = hello.alpn or ()
    return (H2 in offered or GRPC_EXP in offered) and HTTP_1_1 not in offered


def _handshake_message(data: bytes) -> bytes | None:
    """The first handshake message's body, put together from the records' fragments; ``None`` if cut."""
    fragments = bytearray()
    position = 0
    needed: int | None = None  # the message's length, once its header is in
    while needed is None or len(fragments) < _HANDSHAKE_HEADER_BYTES + needed:
        header = data[position : position + _RECORD_HEADER_BYTES]
        if header and not looks_like_tls(header):
            raise NotClientHello("not a TLS handshake record")
        if len(header) < _RECORD_HEADER_BYTES:
            return None
        length = int.from_bytes(header[3:5], "big")
        if not 0 < length <= MAX_RECORD_BYTES:
            raise NotClientHello(f"a TLS record of {length} bytes")
        position += _RECORD_HEADER_BYTES
        fragment = data[position : position + length]
        if len(fragment) < length:
            return None
        position += length
        fragments += fragment
        if needed is None and len(fragments) >= _HANDSHAKE_HEADER_BYTES:
            if fragments[0] != CLIENT_HELLO:
                raise NotClientHello(f"handshake message {fragments[0]}, not a ClientHello")
            needed = int.from_bytes(fragments[1:4], "big")
            if needed > MAX_CLIENT_HELLO_BYTES:
                raise NotClientHello(f"a ClientHello of {needed} bytes")
    return bytes(fragments[_HANDSHAKE_HEADER_BYTES : _HANDSHAKE_HEADER_BYTES + needed])


class _Reader:
    """Reads fields off a byte string, refusing any that runs past its end."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._position = 0

    @property
    def remaining(self) -> int:
        return len(self._data) - self._position

    def take(self, count: int, what: str) -> bytes:
        if count > self.remaining:
            raise NotClientHello(f"{what}: {count} bytes announced, {self.remaining} there")
        start = self._position
        self._position += count
        return self._data[start : self._position]

    def number(self, size: int, what: str) -> int:
        return int.from_bytes(self.take(size, what), "big")

    def vector(self, length_size: int, what: str) -> _Reader:
        """A field that begins with its length in ``length_size`` bytes, as a reader of its own."""
        return _Reader(self.take(self.number(length_size, what), what))


def _alpn(body: _Reader) -> tuple[bytes, ...] | None:
    body.take(2 + 32, "version and random")
    session_id = body.vector(1, "session id")
    if session_id.remaining > 32:
        raise NotClientHello(f"a session id of {session_id.remaining} bytes")
    suites = body.vector(2, "cipher suites")
    if suites.remaining == 0 or suites.remaining % 2:
        raise NotClientHello(f"cipher suites of {suites.remaining} bytes")
    if body.vector(1, "compression methods").remaining == 0:
        raise NotClientHello("no compression method")
    if body.remaining == 0:
        return None  # no extensions at all (allowed before TLS 1.3)
    extensions = body.vector(2, "extensions")
    if body.remaining:
        raise NotClientHello(f"{body.remaining} bytes after the extensions")
    seen: set[int] = set()
    alpn: tuple[bytes, ...] | None = None
    while extensions.remaining:
        kind = extensions.number(2, "extension type")
        data = extensions.vector(2, f"extension {kind}")
        if kind in seen:
            raise NotClientHello(f"extension {kind} twice")
        seen.add(kind)
        if kind == ALPN_EXTENSION:
            alpn = _protocol_names(data)
    return alpn


def _protocol_names(extension: _Reader) -> tuple[bytes, ...]:
    names = extension.vector(2, "ALPN protocol list")
    if extension.remaining or names.remaining == 0:
        raise NotClientHello("a malformed ALPN extension")
    found: list[bytes] = []
    while names.remaining:
        name = names.vector(1, "ALPN protocol name")
        if name.remaining == 0:
            raise NotClientHello("an empty ALPN protocol name")
        found.append(name.take(name.remaining, "ALPN protocol name"))
    return tuple(found)
