"""The ClientHello reader the one-port front routes TLS connections by: real hellos, cut and broken ones.

Real ClientHellos are captured here, not stored: Python's ``ssl`` writes its own into a memory BIO (with
and without ALPN), and a gRPC channel and curl each send theirs to a listening socket of the test. Hand-made
ones (built to the RFC's layout below) reach the cases real clients do not send.
"""

from __future__ import annotations

import collections
import shutil
import socket
import ssl
import subprocess
from collections.abc import Sequence

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hedgepub.server._front.client_hello import (
    MAX_CLIENT_HELLO_BYTES,
    ClientHello,
    NotClientHello,
    read_client_hello,
    wants_grpc,
)


def python_hello(alpn: Sequence[str] | None) -> bytes:
    """The ClientHello Python's ``ssl`` sends, offering ``alpn`` (no ALPN extension when None)."""
    context = ssl.create_default_context()
    if alpn is not None:
        context.set_alpn_protocols(list(alpn))
    outgoing = ssl.MemoryBIO()
    client = context.wrap_bio(ssl.MemoryBIO(), outgoing, server_hostname="localhost")
    with pytest.raises(ssl.SSLWantReadError):  # it waits for the ServerHello, having written its hello
        client.do_handshake()
    return outgoing.read()


def captured_hello(start_client: object) -> bytes:
    """The first bytes a client sends to a listening socket of 127.0.0.1, up to a whole ClientHello.

    ``start_client(port)`` starts the client (and returns something to close, or None).
    """
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(10)
        client = start_client(listener.getsockname()[1])  # type: ignore[operator]
        try:
            connection, _ = listener.accept()
            with connection:
                connection.settimeout(10)
                received = b""
                while True:
                    chunk = connection.recv(65536)
                    assert chunk, received
                    received += chunk
                    if read_client_hello(received) is not None:
                        return received
        finally:
            if client is not None:
                client.close()


def grpc_hello() -> bytes:
    """The ClientHello of a gRPC channel (grpc core, as under the official Pub/Sub client)."""

    def start(port: int) -> grpc.Channel:
        channel = grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials())
        # A call makes the channel connect; closing the channel ends it (CANCELLED, kept in its future).
        # Not grpc.channel_ready_future: its watcher thread, still subscribed when the channel closes
        # before it is ready, dies with "ValueError: Cannot monitor channel state: Channel closed!".
        channel.unary_unary("/google.pubsub.v1.Publisher/GetTopic").future(b"")
        return channel

    return captured_hello(start)


def fragments(hello: bytes, size: int) -> bytes:
    """``hello``'s handshake message split over records of ``size`` bytes (as TLS allows)."""
    assert hello[0] == 22
    message = hello[5 : 5 + int.from_bytes(hello[3:5], "big")]
    return b"".join(
        hello[:3] + len(message[start : start + size]).to_bytes(2, "big") + message[start : start + size]
        for start in range(0, len(message), size)
    )


# A ClientHello built to the layout: record, handshake header, body with the given parts.
def vector(length_size: int, data: bytes) -> bytes:
    return len(data).to_bytes(length_size, "big") + data


def extension(kind: int, data: bytes) -> bytes:
    return kind.to_bytes(2, "big") + vector(2, data)


def alpn_extension(*names: bytes) -> bytes:
    return extension(16, vector(2, b"".join(vector(1, name) for name in names)))


def built_hello(
    extensions: bytes | None = b"",
    *,
    session_id: bytes = b"",
    suites: bytes = b"\x13\x01",
    compression: bytes = b"\x00",
    message_type: int = 1,
) -> bytes:
    body = b"\x03\x03" + bytes(32) + vector(1, session_id) + vector(2, suites) + vector(1, compression)
    if extensions is not None:
        body += vector(2, extensions)
    message = bytes([message_type]) + vector(3, body)
    return b"\x16\x03\x01" + vector(2, message)


# --------------------------------------------------------------------------------------- real clients


@pytest.mark.parametrize(
    ("alpn", "offered", "grpc"),
    [
        (None, None, False),  # requests, urllib, http.client: no ALPN
        (["http/1.1"], (b"http/1.1",), False),  # aiohttp and most HTTP/1.1 clients
        (["h2", "http/1.1"], (b"h2", b"http/1.1"), False),  # curl, Go's net/http, browsers
        (["h2"], (b"h2",), True),  # gRPC clients other than grpc core's
        (["grpc-exp", "h2"], (b"grpc-exp", b"h2"), True),  # older grpc core releases
    ],
)
def test_pythons_own_client_hellos(
    alpn: list[str] | None, offered: tuple[bytes, ...] | None, grpc: bool
) -> None:
    hello = read_client_hello(python_hello(alpn))
    assert hello == ClientHello(alpn=offered)
    assert hello is not None and wants_grpc(hello) is grpc


def test_a_grpc_channels_client_hello_goes_to_grpc() -> None:
    hello = read_client_hello(grpc_hello())
    assert hello is not None and hello.alpn is not None
    assert b"h2" in hello.alpn and b"http/1.1" not in hello.alpn
    assert wants_grpc(hello)


def test_curls_client_hello_goes_to_rest() -> None:
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not on PATH")

    def start(port: int) -> subprocess.Popen[bytes]:
        command = [curl, "-sS", "--max-time", "10", f"https://127.0.0.1:{port}/"]
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    class Ended:
        def __init__(self, process: subprocess.Popen[bytes]) -> None:
            self.process = process

        def close(self) -> None:
            self.process.kill()
            self.process.wait(10)

    hello = read_client_hello(captured_hello(lambda port: Ended(start(port))))
    assert hello is not None
    assert hello.alpn is not None and b"http/1.1" in hello.alpn  # curl offers h2 and http/1.1
    assert not wants_grpc(hello)


@pytest.mark.parametrize("source", ["python", "grpc"])
def test_every_cut_of_a_real_hello_asks_for_more(source: str) -> None:
    hello = python_hello(["h2", "http/1.1"]) if source == "python" else grpc_hello()
    whole = read_client_hello(hello)
    assert whole is not None
    for end in range(len(hello)):
        assert read_client_hello(hello[:end]) is None, end
    # What follows the hello (a client's early data, say) is not looked at.
    assert read_client_hello(hello + b"\x17\x03\x03\x00\x05hello") == whole


@pytest.mark.parametrize("size", [1, 4, 100, 512])
def test_a_hello_split_over_several_records_is_put_back_together(size: int) -> None:
    hello = python_hello(["h2", "http/1.1"])
    split = fragments(hello, size)
    assert read_client_hello(split) == read_client_hello(hello) == ClientHello(alpn=(b"h2", b"http/1.1"))
    for end in range(0, len(split), 7):
        assert read_client_hello(split[:end]) is None, end


def test_every_single_byte_change_of_a_real_hello_is_read_or_refused_cleanly() -> None:
    hello = grpc_hello()
    whole = read_client_hello(hello)
    random = range(5 + 4 + 2, 5 + 4 + 2 + 32)  # after the record and handshake headers and the version
    outcomes: collections.Counter[str] = collections.Counter()
    for position in range(len(hello)):
        for value in (0x00, 0xFF, hello[position] ^ 0x01):
            changed = hello[:position] + bytes([value]) + hello[position + 1 :]
            try:
                result = read_client_hello(changed)
            except NotClientHello:
                outcomes["refused"] += 1
                continue
            outcomes["more needed" if result is None else "read"] += 1
            if position in random:
                assert result == whole
    # Lengths grown ask for more, lengths shrunk or types changed are refused, other bytes change nothing.
    assert outcomes["refused"] and outcomes["more needed"] and outcomes["read"], outcomes


# ------------------------------------------------------------------------------- built, and broken


def test_a_built_hello_reads_as_its_parts() -> None:
    assert read_client_hello(built_hello(None)) == ClientHello(alpn=None)  # no extensions block at all
    assert read_client_hello(built_hello(b"")) == ClientHello(alpn=None)
    both = extension(0, b"\x00") + alpn_extension(b"h2") + extension(43, b"\x02\x03\x04")
    assert read_client_hello(built_hello(both, session_id=bytes(32))) == ClientHello(alpn=(b"h2",))


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "not a TLS handshake record"),
        (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", "not a TLS handshake record"),
        (b"\x16\x02", "not a TLS handshake record"),  # SSL 2 and older
        (b"\x17\x03\x03\x00\x05hello", "not a TLS handshake record"),  # application data
        (b"\x16\x03\x01\x00\x00", "a TLS record of 0 bytes"),
        (b"\x16\x03\x01\x40\x01", "a TLS record of 16385 bytes"),
        (built_hello(message_type=2), "handshake message 2, not a ClientHello"),
        (built_hello(session_id=bytes(33)), "a session id of 33 bytes"),
        (built_hello(suites=b""), "cipher suites of 0 bytes"),
        (built_hello(suites=b"\x13\x01\x13"), "cipher suites of 3 bytes"),
        (built_hello(compression=b""), "no compression method"),
        (built_hello(alpn_extension(b"h2") + alpn_extension(b"http/1.1")), "extension 16 twice"),
        (built_hello(alpn_extension(b"")), "an empty ALPN protocol name"),
        (built_hello(extension(16, vector(2, b""))), "a malformed ALPN extension"),
        (built_hello(extension(16, vector(2, b"\x02h2") + b"x")), "a malformed ALPN extension"),
        (built_hello(extension(16, vector(2, b"\x05h2"))), "ALPN protocol name: 5 bytes announced"),
        (built_hello(extension(16, b"\x00")), "ALPN protocol list: 2 bytes announced"),
    ],
)
def test_broken_hellos_are_refused(data: bytes, reason: str) -> None:
    with pytest.raises(NotClientHello, match=reason):
        read_client_hello(data)


def test_lengths_that_run_past_the_message_are_refused() -> None:
    hello = bytearray(built_hello(alpn_extension(b"h2")))
    hello[-7:-5] = (0xFFFF).to_bytes(2, "big")  # the extension's length
    with pytest.raises(NotClientHello, match="extension 16: 65535 bytes announced"):
        read_client_hello(bytes(hello))
    trailing = built_hello(b"")
    body_length = int.from_bytes(trailing[6:9], "big") + 1
    with_junk = b"\x16\x03\x01" + vector(2, b"\x01" + body_length.to_bytes(3, "big") + trailing[9:] + b"x")
    with pytest.raises(NotClientHello, match="1 bytes after the extensions"):
        read_client_hello(with_junk)


def test_a_hello_longer_than_the_limit_is_refused_without_waiting_for_it() -> None:
    header = b"\x16\x03\x01\x00\x04\x01" + (MAX_CLIENT_HELLO_BYTES + 1).to_bytes(3, "big")
    with pytest.raises(NotClientHello, match="a ClientHello of 65537 bytes"):
        read_client_hello(header)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_are_read_or_refused_cleanly(data: bytes) -> None:
    for candidate in (data, b"\x16\x03\x01" + data, b"\x16\x03\x01" + vector(2, b"\x01" + vector(3, data))):
        try:
            hello = read_client_hello(candidate)
        except NotClientHello:
            continue
        assert hello is None or isinstance(hello, ClientHello)


def test_the_protocols_of_a_grpc_client_and_a_rest_client_by_the_rule() -> None:
    assert wants_grpc(ClientHello(alpn=(b"h2",)))
    assert wants_grpc(ClientHello(alpn=(b"grpc-exp",)))
    assert not wants_grpc(ClientHello(alpn=(b"h2", b"http/1.1")))
    assert not wants_grpc(ClientHello(alpn=(b"http/1.1", b"h2")))
    assert not wants_grpc(ClientHello(alpn=None))
    assert not wants_grpc(ClientHello(alpn=(b"http/1.0",)))
    assert not wants_grpc(ClientHello(alpn=(b"acme-tls/1",)))
