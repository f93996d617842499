"""FaultRelay with real sockets: an echo server, and a real LocalServer with a publisher through it.

Times are only ever checked from below (a pause lasts at least its timeout); a loaded machine makes
everything slower, never faster.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time

import pytest

from hedgepub import AsyncPublisherClient, BatchSettings, PublisherClient
from hedgepub.bench import AdminClient
from hedgepub.server import LocalServer
from hedgepub.testing import FaultRelay
from hedgepub.testing.network.relay import RTO, _next_retransmission

from .._network import EchoServer, connect, receive_exactly

TOPIC = "projects/relay/topics/events"


def wait_until(condition, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout:g} s")
        time.sleep(0.005)


def relayed(relay: FaultRelay, count: int = 1) -> None:
    """Wait until ``count`` connections are relayed (accepted by the relay's loop, not just the kernel)."""
    wait_until(lambda: len(relay.connections) >= count)


def round_trip(client: socket.socket, payload: bytes) -> float:
    started = time.monotonic()
    client.sendall(payload)
    assert receive_exactly(client, len(payload)) == payload
    return time.monotonic() - started


def test_relays_bytes_both_ways_intact(echo_server: EchoServer) -> None:
    payload = os.urandom(3_000_000)
    with (
        FaultRelay(upstream=echo_server.address, max_buffer=64 * 1024) as relay,
        connect(relay.address) as client,
    ):
        received = bytearray()
        client.setblocking(False)
        sent = 0
        # send and receive at once: 3 MB through a 64 KiB buffer per direction
        while len(received) < len(payload):
            if sent < len(payload):
                with contextlib.suppress(BlockingIOError):
                    sent += client.send(payload[sent : sent + 65_536])
            try:
                received += client.recv(65_536)
            except BlockingIOError:
                time.sleep(0.001)
        assert bytes(received) == payload
        [info] = relay.connections
        assert info.bytes_up == info.bytes_down == len(payload)
        assert info.client == client.getsockname()[:2]
        assert info.losses_up == info.losses_down == 0


def test_a_lost_segment_holds_its_direction_for_a_retransmission_timeout(echo_server: EchoServer) -> None:
    with (
        FaultRelay(upstream=echo_server.address, loss=0.05, seed=7) as relay,
        connect(relay.address) as client,
    ):
        relayed(relay)
        held = clean = 0
        for number in range(300):
            before = relay.connections[0]
            took = round_trip(client, b"%05d" % number)
            after = relay.connections[0]
            if (after.losses_up, after.losses_down) != (before.losses_up, before.losses_down):
                held += 1
                assert took >= RTO  # the lost segment waited for its retransmission, the echo behind it
            else:
                clean += 1
        assert held > 0 and clean > 0  # 5% per direction over 300 round trips: both kinds seen


def test_loss_per_direction(echo_server: EchoServer) -> None:
    with FaultRelay(upstream=echo_server.address, seed=3) as relay, connect(relay.address) as client:
        relayed(relay)
        relay.set_loss(0.2, direction="down")
        assert relay.loss == (0.0, 0.2)
        for number in range(60):
            round_trip(client, b"%03d" % number)
        [info] = relay.connections
        assert info.losses_up == 0 and info.losses_down > 0
        relay.set_loss(0.0)
        assert relay.loss == (0.0, 0.0)


def test_retransmission_instants_double() -> None:
    assert _next_retransmission(0.0, 0.0) == 0.0
    assert _next_retransmission(0.0, 0.1) == pytest.approx(0.2)
    assert _next_retransmission(0.0, 5.0) == pytest.approx(6.2)  # 0.2 + 0.4 + 0.8 + 1.6 + 3.2
    assert _next_retransmission(10.0, 10.5) == pytest.approx(10.6)


def test_a_black_hole_swallows_bytes_then_delivers_them(echo_server: EchoServer) -> None:
    with (
        FaultRelay(upstream=echo_server.address) as relay,
        connect(relay.address) as first,
        connect(relay.address) as second,
    ):
        round_trip(first, b"warm")
        round_trip(second, b"warm")
        relayed(relay, 2)
        [chosen] = relay.blackhole(1.0, connections="newest")
        assert chosen.client == second.getsockname()[:2]
        assert chosen.blackholed_until is not None
        started = time.monotonic()
        second.sendall(b"into the hole")
        second.settimeout(0.5)
        with pytest.raises(socket.timeout):  # neither delivered nor refused
            second.recv(100)
        assert round_trip(first, b"the other connection still works") >= 0
        second.settimeout(30)
        assert receive_exactly(second, len(b"into the hole")) == b"into the hole"
        assert time.monotonic() - started >= 1.0
        assert relay.blackhole(0.0, connections=99) == []  # no such connection


def test_a_slow_set_up_answers_nothing_before_its_delay(echo_server: EchoServer) -> None:
    with (
        FaultRelay(upstream=echo_server.address, syn_delay_probability=1.0, syn_delay=0.5) as relay,
        connect(relay.address) as client,
    ):
        started = time.monotonic()
        client.sendall(b"hello")
        assert receive_exactly(client, 5) == b"hello"
        assert time.monotonic() - started >= 0.5
        assert relay.connections[0].syn_delayed


def test_connections_beyond_the_limit_are_reset(echo_server: EchoServer) -> None:
    with (
        FaultRelay(upstream=echo_server.address, max_connections=1) as relay,
        connect(relay.address) as first,
    ):
        round_trip(first, b"one")
        # the reset may show at once (setting an option on the socket) or on the first send or receive
        with pytest.raises((ConnectionError, OSError)), connect(relay.address) as second:
            second.sendall(b"two")
            if not second.recv(10):
                raise ConnectionError("closed")
        assert relay.refused == 1
        assert round_trip(first, b"still") >= 0


def test_memory_is_bounded_when_the_server_stops_reading(echo_server: EchoServer) -> None:
    limit = 32 * 1024
    with (
        FaultRelay(upstream=echo_server.address, max_buffer=limit) as relay,
        connect(relay.address) as client,
    ):
        round_trip(client, b"warm")
        relayed(relay)
        echo_server.reading.clear()
        client.setblocking(False)
        sent = 0
        chunk = b"x" * 65_536
        stalled = 0
        while stalled < 50:  # until the socket buffers and the relay are all full
            try:
                sent += client.send(chunk)
                stalled = 0
            except BlockingIOError:
                stalled += 1
                time.sleep(0.01)
        info = relay.connections[0]
        assert info.held_up <= limit
        echo_server.reading.set()
        client.setblocking(True)
        client.settimeout(30)
        assert len(receive_exactly(client, sent)) == sent  # nothing lost on the way


def test_an_upstream_that_refuses_is_passed_on() -> None:
    unused = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{unused.getsockname()[1]}"
    unused.close()
    with FaultRelay(upstream=address) as relay:
        # the relay's reset may arrive before the client's connect returns, or at its first read
        with contextlib.suppress(ConnectionError), connect(relay.address) as client:
            client.settimeout(30)
            assert client.recv(10) == b""
        wait_until(lambda: relay.accepted == 1 and relay.connections == [])


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"upstream": "nowhere"}, "upstream must be HOST:PORT"),
        ({"upstream": "127.0.0.1:1", "listen": "127.0.0.1:x"}, "listen must be HOST:PORT"),
        ({"upstream": "127.0.0.1:1", "loss": 1.5}, "loss must be a probability"),
        ({"upstream": "127.0.0.1:1", "syn_delay_probability": -0.1}, "syn_delay_probability"),
        ({"upstream": "127.0.0.1:1", "syn_delay": float("inf")}, "syn_delay must be"),
        ({"upstream": "127.0.0.1:1", "max_connections": 0}, "max_connections must be"),
        ({"upstream": "127.0.0.1:1", "max_buffer": True}, "max_buffer must be"),
    ],
)
def test_bad_arguments_are_refused(arguments: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=message):
        FaultRelay(**arguments)


def test_bad_fault_calls_are_refused(echo_server: EchoServer) -> None:
    relay = FaultRelay(upstream=echo_server.address)
    with pytest.raises(RuntimeError, match="not started"):
        relay.blackhole(1.0)
    with pytest.raises(RuntimeError, match="not started"):
        _ = relay.address
    with relay:
        with pytest.raises(ValueError, match="direction"):
            relay.set_loss(0.1, direction="sideways")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="probability"):
            relay.set_loss(2.0)
        with pytest.raises(ValueError, match="seconds"):
            relay.blackhole(-1.0)
        with pytest.raises(ValueError, match="connections"):
            relay.blackhole(1.0, connections="oldest")  # type: ignore[arg-type]
    relay.close()  # twice is fine


def test_a_publish_through_the_relay_to_a_local_server() -> None:
    with LocalServer(in_memory=True) as server, FaultRelay(upstream=server.address) as relay:
        with AdminClient(server.address) as admin:
            admin.wait_ready(10.0)
            admin.create_topic(TOPIC)
        with PublisherClient(
            endpoint=relay.address, batch_settings=BatchSettings(max_messages=1), channel_pool_size=1
        ) as publisher:
            ids = [publisher.publish(TOPIC, b"through %d" % n).result(timeout=60) for n in range(5)]
            [info] = relay.connections  # one channel, one TCP connection
            assert info.bytes_up > 5 * len(b"through 0") and info.bytes_down > 0
        assert len(set(ids)) == 5
        assert sorted(m.data for m in server.messages(TOPIC)) == sorted(b"through %d" % n for n in range(5))


async def test_from_asyncio_with_loss_every_publish_is_stored() -> None:
    with LocalServer(in_memory=True) as server:
        with AdminClient(server.address) as admin:
            admin.wait_ready(10.0)
            admin.create_topic(TOPIC)
        async with FaultRelay(upstream=server.address, loss=0.2, seed=11) as relay:
            publisher = AsyncPublisherClient(
                endpoint=relay.address, batch_settings=BatchSettings(max_messages=1), channel_pool_size=1
            )
            try:  # one at a time: each publish is its own segments both ways, each lost 1 time in 5
                ids = [await publisher.publish(TOPIC, b"lossy %d" % n) for n in range(20)]
            finally:
                await publisher.shutdown(timeout=60)
            [info] = relay.connections
            assert info.losses_up + info.losses_down > 0
        assert len(set(ids)) == 20
        assert sorted(m.data for m in server.messages(TOPIC)) == sorted(b"lossy %d" % n for n in range(20))
