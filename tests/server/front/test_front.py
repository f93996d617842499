"""The one-port front: how it tells gRPC from HTTP/1.1 (by the first bytes, or on a TLS port by the
ClientHello's ALPN), relays large messages both ways, and stops.

Raw sockets stand in for clients where the test is about the bytes (a first request that arrives a byte
at a time, a connection that says nothing); the official client where it is about gRPC working
through the relay.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import os
import re
import resource
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from google.cloud import pubsub_v1
from google.pubsub_v1.services.publisher.transports import PublisherGrpcTransport
from google.pubsub_v1.services.subscriber.transports import SubscriberGrpcTransport

from hedgepub.server import LocalServer
from hedgepub.server._front.front import HTTP2_PREFACE

from ..._pb import PublishRequest, PublishResponse, PullRequest, PullResponse, Topic
from ..._tls import Certificates

PROJECT = "projects/front-project"


#: Connections relayed at once by the many-connections test; HEDGEPUB_RELAY_CONNECTIONS=500 in the large.
CONNECTIONS = int(os.environ.get("HEDGEPUB_RELAY_CONNECTIONS", "") or 40)
#: Both ways the front relays gRPC: by its relay process (Linux) and on the server's event loop.
RELAYS = ["process", "loop"]


@pytest.fixture(params=RELAYS)
def server(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalServer]:
    with LocalServer(in_memory=True, relay=request.param) as local:
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", local.address)
        yield local


def _connect(server: LocalServer) -> socket.socket:
    connection = socket.create_connection((server.host, server.port), timeout=10)
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return connection


def _read_until_closed_or(connection: socket.socket, marker: bytes) -> bytes:
    received = b""
    while marker not in received:
        chunk = connection.recv(65536)
        if not chunk:
            break
        received += chunk
    return received


def test_a_request_arriving_a_byte_at_a_time_is_still_told_apart(server: LocalServer) -> None:
    with _connect(server) as connection:
        # "P" could begin PRI (HTTP/2), POST, PUT or PATCH: the front waits for more before deciding.
        request = (
            b"PUT /v1/projects/front-project/topics/slow HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
        )
        connection.sendall(request[:1])
        time.sleep(0.05)
        connection.sendall(request[1:2])
        time.sleep(0.05)
        connection.sendall(request[2:])
        answer = _read_until_closed_or(connection, b"}")
    assert answer.startswith(b"HTTP/1.1 200 OK")
    assert b'"name": "projects/front-project/topics/slow"' in answer


def test_the_http2_preface_reaches_the_grpc_face(server: LocalServer) -> None:
    with _connect(server) as connection:
        connection.sendall(HTTP2_PREFACE[:2])
        time.sleep(0.05)
        connection.sendall(HTTP2_PREFACE[2:])
        frame = connection.recv(9)
    # The gRPC server's first frame: a SETTINGS frame (type 4) on stream 0.
    assert len(frame) == 9 and frame[3] == 0x4 and frame[5:9] == b"\x00\x00\x00\x00"


def test_a_connection_that_says_nothing_harms_no_other(server: LocalServer) -> None:
    silent = _connect(server)
    closed = _connect(server)
    closed.close()
    publisher = pubsub_v1.PublisherClient()
    assert publisher.create_topic(name=f"{PROJECT}/topics/fine").name == f"{PROJECT}/topics/fine"
    publisher.stop()
    silent.close()


def test_large_messages_cross_the_relay_both_ways(server: LocalServer) -> None:
    topic, subscription = f"{PROJECT}/topics/large", f"{PROJECT}/subscriptions/large-sub"
    publisher, subscriber = pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
    try:
        publisher.create_topic(name=topic)
        subscriber.create_subscription(name=subscription, topic=topic)
        # Near the 10 MB limit: far more than a socket buffer, so the relay must wait to write, both ways.
        data = bytes(range(256)) * (9_000_000 // 256)
        publisher.publish(topic, data).result(timeout=60)
        # Pulled on a channel that takes messages over gRPC's default 4 MB limit.
        options = [("grpc.max_receive_message_length", 20_000_000)]
        with grpc.insecure_channel(server.address, options=options) as channel:
            pull = channel.unary_unary(
                "/google.pubsub.v1.Subscriber/Pull",
                request_serializer=PullRequest.SerializeToString,
                response_deserializer=PullResponse.FromString,
            )
            response = pull(PullRequest(subscription=subscription, max_messages=1), timeout=60)
        assert [received.message.data for received in response.received_messages] == [data]
    finally:
        publisher.stop()
        subscriber.close()


@pytest.mark.parametrize("relay", RELAYS)
def test_stopping_the_server_closes_relayed_connections(relay: str) -> None:
    server = LocalServer(in_memory=True, relay=relay).start()
    connection = _connect(server)
    try:
        connection.sendall(HTTP2_PREFACE)
        assert connection.recv(9)  # relayed: the gRPC face answered
        server.stop(0)
        connection.settimeout(10)
        assert _read_until_closed_or(connection, b"never sent") is not None  # returns once closed
    finally:
        connection.close()
        server.stop()


def test_the_request_log_names_the_client_of_a_relayed_call(
    server: LocalServer, caplog: pytest.LogCaptureFixture, wait_for: Callable[..., bool]
) -> None:
    publisher = pubsub_v1.PublisherClient()
    try:
        with caplog.at_level(logging.DEBUG, logger="hedgepub.server.requests"):
            publisher.create_topic(name=f"{PROJECT}/topics/logged")
            # Logged when the handler ends, on the server's thread: maybe just after the client's answer.
            wait_for(lambda: any(record.name == "hedgepub.server.requests" for record in caplog.records))
    finally:
        publisher.stop()
    [logged] = [record.getMessage() for record in caplog.records if record.name == "hedgepub.server.requests"]
    # The client's own address, not the front's connection to the gRPC face.
    assert re.fullmatch(r"CreateTopic OK [\d.]+ ms \(peer ipv4:127\.0\.0\.1:\d+\)", logged)


def _wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _relay_processes(parent: int) -> list[int]:
    """The relay processes whose parent is ``parent`` (or, with ``parent`` 0, any)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                if b"_front/relay.py" not in cmdline.read():
                    continue
            with open(f"/proc/{entry}/stat") as stat:
                parent_pid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if parent in (0, parent_pid):
            found.append(int(entry))
    return found


def _the_relay_process(parent: int) -> int:
    """The one relay process of ``parent``, once it runs (between fork and exec it is not yet known)."""
    assert _wait_for(lambda: len(_relay_processes(parent)) == 1), _relay_processes(parent)
    [relay] = _relay_processes(parent)
    return relay


def _wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if os.path.exists(f"/proc/{pid}") and _state(pid) != "Z"]
        if not alive:
            return []
        time.sleep(0.02)
    return alive


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the relay process is Linux's")


@linux_only
def test_grpc_goes_on_when_the_relay_process_dies(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with LocalServer(in_memory=True, relay="process") as server:
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", server.address)
        relay = _the_relay_process(os.getpid())
        os.kill(relay, signal.SIGKILL)
        assert _wait_gone([relay]) == []
        # A connection made after the death is relayed on the event loop instead, and works.
        publisher = pubsub_v1.PublisherClient()
        try:
            with caplog.at_level(logging.WARNING, logger="hedgepub.server"):
                assert (
                    publisher.create_topic(name=f"{PROJECT}/topics/after").name == f"{PROJECT}/topics/after"
                )
        finally:
            publisher.stop()
    assert any("relay process is gone" in record.getMessage() for record in caplog.records)


def _descriptors(pid: int) -> Counter[str]:
    """How many sockets, pipes, ... process ``pid`` holds open."""
    kinds: Counter[str] = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            kinds[os.readlink(f"/proc/{pid}/fd/{fd}").split(":")[0]] += 1
    return kinds


def _publish_call(channel: grpc.Channel) -> Any:
    return channel.unary_unary(
        "/google.pubsub.v1.Publisher/Publish",
        request_serializer=PublishRequest.SerializeToString,
        response_deserializer=PublishResponse.FromString,
    )


@linux_only
def test_the_relay_process_serves_many_connections_at_once_and_keeps_none_it_closed() -> None:
    topic = f"{PROJECT}/topics/many"
    with LocalServer(in_memory=True, relay="process") as server:
        relay = _the_relay_process(os.getpid())
        # Ready once it has its epoll instance (it starts in tens of milliseconds).
        assert _wait_for(lambda: _descriptors(relay)["anon_inode"] == 1)
        idle = _descriptors(relay)
        # Each its own connection: channels to one address otherwise share one.
        channels = [
            grpc.insecure_channel(server.address, options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(CONNECTIONS)
        ]
        try:
            publishes = [_publish_call(channel) for channel in channels]
            channels[0].unary_unary("/google.pubsub.v1.Publisher/CreateTopic")(
                Topic(name=topic).SerializeToString(), timeout=10
            )
            # Every connection open at once, each call answered on its own connection, twice round.
            for round_number in range(2):
                futures = [
                    publish.future(
                        PublishRequest(topic=topic, messages=[{"data": b"%d-%d" % (round_number, index)}]),
                        timeout=30,
                    )
                    for index, publish in enumerate(publishes)
                ]
                assert all(len(future.result().message_ids) == 1 for future in futures)
            # Relayed by the process, not the loop: both sockets of each connection, a pipe each way.
            busy = _descriptors(relay)
            assert busy["socket"] - idle["socket"] == 2 * CONNECTIONS
            assert busy["pipe"] - idle["pipe"] == 4 * CONNECTIONS
        finally:
            for channel in channels:
                channel.close()
        # Once the clients have gone, the relay has closed both sockets and the pipes of each connection.
        assert _wait_for(lambda: _descriptors(relay) == idle), _descriptors(relay)


@linux_only
@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs or more"
)
@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        (None, lambda allowed: {max(allowed)}),  # the default: the last CPU it may use
        ("any", lambda allowed: allowed),  # left to the scheduler
        (0, lambda allowed: {0}),
        (1 << 16, lambda allowed: allowed),  # no such CPU: said on stderr, and relaying goes on unpinned
    ],
)
def test_the_relay_process_keeps_to_one_cpu_unless_told_otherwise(
    setting: int | str | None, expected: Callable[[set[int]], set[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    allowed = os.sched_getaffinity(0)
    with LocalServer(in_memory=True, relay="process", relay_cpu=setting) as server:
        relay = _the_relay_process(os.getpid())
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", server.address)
        publisher = pubsub_v1.PublisherClient()
        try:  # relayed, whatever the setting
            assert publisher.create_topic(name=f"{PROJECT}/topics/cpu").name == f"{PROJECT}/topics/cpu"
        finally:
            publisher.stop()
        assert os.sched_getaffinity(relay) == expected(allowed)


@linux_only
def test_the_relay_process_runs_out_of_descriptors_one_connection_at_a_time(
    capfd: pytest.CaptureFixture[str],
) -> None:
    topic = f"{PROJECT}/topics/descriptors"
    own_connection = [("grpc.use_local_subchannel_pool", 1)]
    with LocalServer(in_memory=True, relay="process") as server:
        relay = _the_relay_process(os.getpid())
        assert _wait_for(lambda: _descriptors(relay)["anon_inode"] == 1)
        # It raised its own limit as far as it may (a soft limit is often 1,024, six a connection).
        soft, hard = resource.prlimit(relay, resource.RLIMIT_NOFILE)
        assert soft == hard
        # Now room for two connections, no more.
        resource.prlimit(relay, resource.RLIMIT_NOFILE, (sum(_descriptors(relay).values()) + 12, hard))
        first, second, third = (grpc.insecure_channel(server.address, options=own_connection) for _ in "123")
        try:
            first.unary_unary("/google.pubsub.v1.Publisher/CreateTopic")(
                Topic(name=topic).SerializeToString(), timeout=10
            )
            request = PublishRequest(topic=topic, messages=[{"data": b"x"}])
            assert _publish_call(second)(request, timeout=10).message_ids
            # The third connection finds none left: it alone is closed, and says so.
            with pytest.raises(grpc.RpcError) as refused:
                _publish_call(third)(request, timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "hedgepub relay: cannot relay a connection" in capfd.readouterr().err
            # The others go on, and once one has gone, a new one is relayed again.
            assert _publish_call(first)(request, timeout=10).message_ids
            second.close()
            assert _wait_for(lambda: _descriptors(relay)["socket"] <= 3)
            # (the refused channel waits out its reconnect back-off first)
            assert _publish_call(third)(request, timeout=30, wait_for_ready=True).message_ids
        finally:
            for channel in (first, second, third):
                channel.close()


@linux_only
def test_no_relay_process_outlives_its_server(tmp_path: Any) -> None:
    # LocalServer: stopping it ends its relay process.
    with LocalServer(in_memory=True):
        relays = [_the_relay_process(os.getpid())]
    assert _wait_gone(relays) == []
    # hedgepub serve, SIGKILLed with a connection being relayed: its relay process ends too. Started with a
    # soft descriptor limit below the hard one, as is common (1,024), which it and its relay raise.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = min(soft, hard // 2, 1024)
    serve = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from hedgepub.cli import main; main()",
            "serve",
            "--in-memory",
            "--port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard)),
    )
    try:
        assert serve.stdout is not None
        line = serve.stdout.readline().decode()
        address = re.search(r"PUBSUB_EMULATOR_HOST=(\S+)", line)
        assert address is not None, line
        host, port = address.group(1).rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as connection:
            connection.sendall(HTTP2_PREFACE)
            assert connection.recv(9)  # relayed: the gRPC face answered
            relays = [_the_relay_process(serve.pid)]
            assert resource.prlimit(serve.pid, resource.RLIMIT_NOFILE) == (hard, hard)
            assert resource.prlimit(relays[0], resource.RLIMIT_NOFILE) == (hard, hard)
            serve.kill()
            serve.wait()
            assert _wait_gone(relays) == []
            connection.settimeout(10)
            assert _read_until_closed_or(connection, b"never sent") is not None  # returns once closed
    finally:
        serve.kill()
        serve.wait()


# --------------------------------------------------------------------------------------- on a TLS port


@pytest.fixture(params=RELAYS)
def tls_server(request: pytest.FixtureRequest, certificates: Certificates) -> Iterator[LocalServer]:
    with LocalServer(
        in_memory=True, tls_cert=certificates.cert, tls_key=certificates.key, relay=request.param
    ) as local:
        yield local


def _tls_handshake(
    connection: socket.socket, ca: Any, alpn: list[str], pieces: int = 1
) -> tuple[ssl.SSLObject, ssl.MemoryBIO, ssl.MemoryBIO]:
    """A TLS handshake over ``connection``, driven by hand so that the ClientHello can be sent in
    ``pieces`` pauses apart; the client's TLS object and its two memory BIOs."""
    context = ssl.create_default_context(cafile=str(ca))
    context.set_alpn_protocols(alpn)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = context.wrap_bio(incoming, outgoing, server_hostname="localhost")
    first = True
    while True:
        try:
            client.do_handshake()
            done = True
        except ssl.SSLWantReadError:
            done = False
        data = outgoing.read()
        if first:  # the ClientHello, cut in pieces
            step = -(-len(data) // pieces)
            for start in range(0, len(data), step):
                connection.sendall(data[start : start + step])
                time.sleep(0.05)
            first = False
        elif data:
            connection.sendall(data)
        if done:
            return client, incoming, outgoing
        chunk = connection.recv(65536)
        assert chunk, "the server closed the connection during the handshake"
        incoming.write(chunk)


@pytest.mark.parametrize(("alpn", "reaches"), [(["h2"], "h2"), (["h2", "http/1.1"], "http/1.1"), ([], None)])
def test_a_client_hello_arriving_in_pieces_is_still_told_apart(
    tls_server: LocalServer, certificates: Certificates, alpn: list[str], reaches: str | None
) -> None:
    with _connect(tls_server) as connection:
        client, incoming, outgoing = _tls_handshake(connection, certificates.ca, alpn, pieces=4)
        # The gRPC face's TLS chose h2, the REST front's http/1.1 (or nothing, offered nothing).
        assert client.selected_alpn_protocol() == reaches
        if reaches == "h2":
            client.write(HTTP2_PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")  # preface, SETTINGS
            connection.sendall(outgoing.read())
            frame = b""
            while len(frame) < 9:
                try:
                    frame += client.read(9 - len(frame))
                except ssl.SSLWantReadError:
                    incoming.write(connection.recv(65536))
            assert frame[3] == 0x4  # the gRPC server's SETTINGS frame
        else:
            client.write(b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            connection.sendall(outgoing.read())
            answer = b""
            while b"Ok\n" not in answer:
                try:
                    answer += client.read(65536)
                except ssl.SSLWantReadError:
                    chunk = connection.recv(65536)
                    assert chunk, answer
                    incoming.write(chunk)
            assert answer.startswith(b"HTTP/1.1 200 OK")


@pytest.mark.parametrize(
    ("first_bytes", "answer"),
    [
        # A gRPC client in plain text: the answer tells grpc core it reached an HTTP/1 server.
        (HTTP2_PREFACE, b"HTTP/1.0 400 Bad Request\r\n"),
        (b"\x00\x01\x02\x03\x04\x05", b""),  # nothing at all
        (b"\x16\x03\x01\x00\x05\x02\x00\x00\x01\x00", b""),  # a TLS handshake record, not a ClientHello
    ],
)
def test_what_is_not_a_tls_client_hello_is_closed(
    tls_server: LocalServer, first_bytes: bytes, answer: bytes
) -> None:
    with _connect(tls_server) as connection:
        connection.sendall(first_bytes)
        assert _read_until_closed_or(connection, b"never sent").startswith(answer)  # once closed


def test_a_plain_text_http_request_to_the_tls_port_is_told_to_use_tls(tls_server: LocalServer) -> None:
    connection = http.client.HTTPConnection(tls_server.host, tls_server.port, timeout=10)
    connection.request("GET", "/v1/projects/front-project/topics")
    response = connection.getresponse()
    assert (response.status, response.read()) == (400, b"This port speaks TLS: use https://.\n")
    connection.close()


def test_grpc_and_large_messages_cross_the_tls_relay(
    tls_server: LocalServer, certificates: Certificates
) -> None:
    topic, subscription = f"{PROJECT}/topics/tls", f"{PROJECT}/subscriptions/tls-sub"
    credentials = grpc.ssl_channel_credentials(root_certificates=certificates.ca.read_bytes())
    options = [("grpc.max_receive_message_length", 20_000_000), ("grpc.max_send_message_length", 20_000_000)]
    with grpc.secure_channel(tls_server.address, credentials, options=options) as channel:
        publisher = pubsub_v1.PublisherClient(transport=PublisherGrpcTransport(channel=channel))
        subscriber = pubsub_v1.SubscriberClient(transport=SubscriberGrpcTransport(channel=channel))
        publisher.create_topic(name=topic)
        subscriber.create_subscription(name=subscription, topic=topic)
        data = bytes(range(256)) * (6_000_000 // 256)  # more than socket buffers hold, both ways
        publisher.publish(topic, data).result(timeout=60)
        publisher.publish(topic, b"small").result(timeout=60)
        pulled = []
        while len(pulled) < 2:
            response = subscriber.pull(subscription=subscription, max_messages=2, timeout=60)
            pulled += response.received_messages
        assert sorted(len(received.message.data) for received in pulled) == [5, len(data)]
        assert data in [received.message.data for received in pulled]
        publisher.stop()


def test_the_request_log_names_the_client_over_tls_for_grpc_and_rest(
    tls_server: LocalServer,
    certificates: Certificates,
    caplog: pytest.LogCaptureFixture,
    wait_for: Callable[..., bool],
) -> None:
    def logged() -> list[str]:
        return [record.getMessage() for record in caplog.records if record.name == "hedgepub.server.requests"]

    credentials = grpc.ssl_channel_credentials(root_certificates=certificates.ca.read_bytes())
    context = ssl.create_default_context(cafile=str(certificates.ca))
    https = http.client.HTTPSConnection(tls_server.host, tls_server.port, context=context, timeout=10)
    with caplog.at_level(logging.DEBUG, logger="hedgepub.server.requests"):
        with grpc.secure_channel(tls_server.address, credentials) as channel:
            publisher = pubsub_v1.PublisherClient(transport=PublisherGrpcTransport(channel=channel))
            publisher.create_topic(name=f"{PROJECT}/topics/logged")
            publisher.stop()
        https.request("GET", f"/v1/{PROJECT}/topics/logged")
        assert https.getresponse().status == 200
        https.close()
        # Logged when the handler ends, on the server's thread: maybe just after the client's answer.
        wait_for(lambda: len(logged()) == 2)
    # The clients' own addresses, not the front's connection to the gRPC face nor the REST gateway's.
    grpc_line, rest_line = logged()
    assert re.fullmatch(r"CreateTopic OK [\d.]+ ms \(peer ipv4:127\.0\.0\.1:\d+\)", grpc_line)
    assert re.fullmatch(r"GetTopic OK [\d.]+ ms \(peer ipv4:127\.0\.0\.1:\d+ over REST\)", rest_line)
