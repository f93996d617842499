"""Hedges to other endpoints: the rotation and the spec's rules on virtual time, then real local servers."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Iterator

import pytest

from hedgepub import (
    AsyncPublisherClient,
    BatchSettings,
    ConnectionStats,
    EndpointStats,
    HedgingSettings,
    PublisherClient,
    RpcError,
    StatusCode,
)
from hedgepub._publisher.routes import EndpointRoutes
from hedgepub._transport.pool import ConnectionPool
from hedgepub._wire import CLIENT_TELEMETRY_KEY, decode_client_telemetry
from hedgepub.bench import AdminClient
from hedgepub.server import FaultRule, LocalServer, StallWindows
from hedgepub.testing.scripted import ScriptedTransport
from hedgepub.testing.virtual_time import virtual_time

TOPIC = "projects/test-project/topics/topic"


def now() -> float:
    return asyncio.get_running_loop().time()


async def publisher_with_endpoints(
    hedge_endpoints: int, *, max_tokens: int = 5
) -> tuple[ScriptedTransport, list[ScriptedTransport], AsyncPublisherClient]:
    """A hedging publisher with scripted primary and hedge endpoints, its bucket full."""
    primary = ScriptedTransport()
    others = [ScriptedTransport() for _ in range(hedge_endpoints)]
    publisher = AsyncPublisherClient(
        hedging_settings=HedgingSettings(hedge_delay=0.1, max_tokens=max_tokens, refill_ratio=0.2),
        transport=primary,
        hedge_transports=others,
    )
    for _ in range(max_tokens * 5):  # quick batches on the primary fill the bucket
        await publisher.publish(TOPIC, b"warm-up")
    assert publisher.stats().tokens_available == max_tokens
    primary.calls.clear()
    return primary, others, publisher


def attempt_numbers(transport: ScriptedTransport) -> list[str]:
    return [str(decode_client_telemetry(call.metadata[CLIENT_TELEMETRY_KEY])[0]) for call in transport.calls]


@virtual_time
async def test_hedges_go_to_the_hedge_endpoints_in_turn() -> None:
    primary, (first, second), publisher = await publisher_with_endpoints(2)
    primary.script.append(primary.ok(delay=0.35))
    first.default = first.ok(delay=5.0)
    second.default = second.ok(delay=5.0)
    started = now()
    await publisher.publish(TOPIC, b"slow")
    # The batch goes out at 0.01 s; hedges 1, 2 and 3 at 0.11, 0.21 and 0.31 s go to the first, the
    # second and the first endpoint again; the original wins at 0.36 s.
    assert now() - started == pytest.approx(0.36)
    assert attempt_numbers(primary) == ["0"]
    assert attempt_numbers(first) == ["1", "3"]
    assert attempt_numbers(second) == ["2"]
    batch_ids = {call.metadata["hedgepub-batch-id"] for t in (primary, first, second) for call in t.calls}
    assert len(batch_ids) == 1  # every copy carries the batch's id, wherever it goes
    assert [call.timeout for call in first.calls] == [10.0, 10.0]  # min(time left, 10 s)
    await asyncio.sleep(0.001)
    assert [call.outcome for call in (*first.calls, *second.calls)] == ["cancelled"] * 3
    stats = publisher.stats()
    assert (stats.hedges_sent, stats.hedges_won, stats.tokens_available) == (3, 0, pytest.approx(2.2))
    assert list(stats.endpoints) == ["primary", "hedge-endpoint-1", "hedge-endpoint-2"]
    assert stats.endpoints["primary"].attempts_sent == 26  # 25 warm-up batches and the original
    assert stats.endpoints["primary"].wins == 26
    assert stats.endpoints["hedge-endpoint-1"] == EndpointStats(
        attempts_sent=2, hedges_sent=2, connections=(ConnectionStats(attempts_sent=2),)
    )
    assert stats.endpoints["hedge-endpoint-2"] == EndpointStats(
        attempts_sent=1, hedges_sent=1, connections=(ConnectionStats(attempts_sent=1),)
    )
    await publisher.shutdown()
    assert primary.closed and first.closed and second.closed


@virtual_time
async def test_the_endpoints_add_up_to_the_publisher_totals() -> None:
    primary, (first, second), publisher = await publisher_with_endpoints(2, max_tokens=20)
    # Answers that land on hedge points too: a hedge decided in the same instant as the original's answer
    # is counted by the engine, and so on its endpoint, even if its task never reached the transport.
    primary.default = primary.ok(delay=0.2)
    first.default = first.ok(delay=0.1)
    second.default = second.fail(StatusCode.UNAVAILABLE, delay=0.05)
    await asyncio.gather(*(publisher.publish(TOPIC, b"%d" % number) for number in range(30)))
    stats = publisher.stats()
    endpoints = stats.endpoints.values()
    assert sum(endpoint.attempts_sent for endpoint in endpoints) == stats.attempts_sent
    assert sum(endpoint.hedges_sent for endpoint in endpoints) == stats.hedges_sent > 0
    assert sum(endpoint.wins for endpoint in endpoints) == stats.batches_sent
    assert stats.endpoints["hedge-endpoint-2"].wins == 0
    await publisher.shutdown()


@virtual_time
async def test_a_hedge_endpoint_that_answers_first_wins() -> None:
    primary, (other,), publisher = await publisher_with_endpoints(1)
    primary.script.append(primary.ok(delay=2.0))
    other.script.append(other.ok(delay=0.02))
    started = now()
    assert await publisher.publish(TOPIC, b"escapes the stall") == "0"  # the hedge endpoint's first ID
    assert now() - started == pytest.approx(0.13)
    await asyncio.sleep(0.001)
    assert primary.calls[-1].outcome == "cancelled"
    stats = publisher.stats()
    assert stats.hedges_won == 1
    hedged = stats.endpoints["hedge-endpoint-1"]
    assert (hedged.attempts_sent, hedged.hedges_sent, hedged.wins, hedged.attempts_failed) == (1, 1, 1, 0)
    assert hedged.p50_ms == pytest.approx(20.0, rel=0.01)
    await publisher.shutdown()


@virtual_time
async def test_retries_stay_on_the_primary() -> None:
    primary, (other,), publisher = await publisher_with_endpoints(1)
    primary.script.extend([primary.fail(StatusCode.UNAVAILABLE, delay=0.15), primary.ok(delay=0.03)])
    other.default = other.fail(StatusCode.UNAVAILABLE, delay=1.0)
    await publisher.publish(TOPIC, b"x")
    # The original (sent at 0.01 s) fails at 0.16 s, backs off 0.1 s, and its retry (attempt 0 again)
    # wins at 0.29 s.
    assert attempt_numbers(primary) == ["0", "0"]
    assert attempt_numbers(other) == ["1", "2"]  # hedges at 0.1 and 0.2 s
    await publisher.shutdown()


@virtual_time
async def test_an_unreachable_hedge_endpoint_fails_only_its_hedges() -> None:
    primary, (unreachable,), publisher = await publisher_with_endpoints(1)
    primary.script.append(primary.ok(delay=0.45))
    unreachable.default = unreachable.fail(StatusCode.UNAVAILABLE, message="connection refused")
    assert await publisher.publish(TOPIC, b"x") is not None
    stats = publisher.stats()
    # Every hedge point sent one quick-failing hedge (0.1 ... 0.4 s); none failed the batch.
    assert attempt_numbers(unreachable) == ["1", "2", "3", "4"]
    assert stats.endpoints["hedge-endpoint-1"].attempts_failed == 4
    assert stats.endpoints["primary"].wins == 26
    assert (stats.messages_failed, stats.hedges_sent, stats.hedges_won) == (0, 4, 0)
    await publisher.shutdown()


@virtual_time
async def test_a_hedge_endpoint_that_refuses_does_not_fail_a_batch_the_primary_stores() -> None:
    # Rule 4: one region's PERMISSION_DENIED ends only its hedge; the user sees the primary's success.
    primary, (other,), publisher = await publisher_with_endpoints(1)
    primary.script.append(primary.ok(delay=1.0))
    other.script.append(other.fail(StatusCode.PERMISSION_DENIED))
    message_id = await publisher.publish(TOPIC, b"x")
    assert message_id
    assert len(other.calls) >= 1  # the hedge was sent and refused
    assert publisher.stats().messages_failed == 0
    await publisher.shutdown()


@virtual_time
async def test_a_primary_that_refuses_waits_for_the_hedge_endpoint_that_stores() -> None:
    primary, (other,), publisher = await publisher_with_endpoints(1, max_tokens=1)
    primary.script.append(primary.fail(StatusCode.PERMISSION_DENIED, delay=0.3))
    other.script.append(other.ok(delay=0.5))
    started = now()
    message_id = await publisher.publish(TOPIC, b"x")
    assert message_id
    assert now() - started == pytest.approx(0.61)  # sent at 0.01, hedged at 0.11, stored at 0.61
    await publisher.shutdown()


@virtual_time
async def test_when_every_endpoint_refuses_the_batch_fails_with_the_primarys_error() -> None:
    primary, (other,), publisher = await publisher_with_endpoints(1, max_tokens=1)
    primary.script.append(primary.fail(StatusCode.PERMISSION_DENIED, delay=0.3))
    other.script.append(other.fail(StatusCode.NOT_FOUND, delay=0.5))
    with pytest.raises(RpcError) as raised:
        await publisher.publish(TOPIC, b"x")
    assert raised.value.code is StatusCode.PERMISSION_DENIED
    await publisher.shutdown()


@virtual_time
async def test_no_token_no_hedge_to_any_endpoint() -> None:
    primary = ScriptedTransport(default=ScriptedTransport().ok(delay=0.5))
    other = ScriptedTransport()
    publisher = AsyncPublisherClient(
        hedging_settings=HedgingSettings(hedge_delay=0.1), transport=primary, hedge_transports=[other]
    )
    await publisher.publish(TOPIC, b"x")
    assert other.calls == []
    assert publisher.stats().hedges_skipped == 1
    await publisher.shutdown()


def test_every_endpoint_is_opened_once_before_the_first_attempt() -> None:
    opened: list[str] = []

    def opener(label: str) -> ConnectionPool:
        def connect(key: int) -> ScriptedTransport:
            opened.append(f"{label}/{key}")
            return ScriptedTransport()

        return ConnectionPool(connect, 2)

    def broken(key: int) -> ScriptedTransport:
        raise OSError("no such certificate file")

    routes = EndpointRoutes(
        ["primary", "a:1", "b:2", "c:3"],
        [opener("primary"), opener("a:1"), opener("b:2"), ConnectionPool(broken, 2)],
    )
    routes.open_all()
    routes.open_all()
    # Each endpoint's pool of two connections, each connection opened by a call of its own.
    assert opened == ["primary/0", "primary/1", "a:1/0", "a:1/1", "b:2/0", "b:2/1"]
    assert [routes.index_for(number) for number in range(6)] == [0, 1, 2, 3, 1, 2]
    # An endpoint that cannot be opened fails its hedges as an unreachable one would: retryably.
    with pytest.raises(RpcError) as raised:
        routes.pool(3)
    assert raised.value.code is StatusCode.UNAVAILABLE
    assert "cannot open hedge endpoint c:3: no such certificate file" in str(raised.value)


def test_hedge_endpoints_are_checked_at_construction() -> None:
    hedging = HedgingSettings(hedge_delay=0.1)
    with pytest.raises(ValueError, match="needs hedging"):
        PublisherClient(endpoint="127.0.0.1:1", hedge_endpoints=["127.0.0.1:2"])
    with pytest.raises(TypeError, match="must be a list of endpoints"):
        PublisherClient(hedging_settings=hedging, endpoint="127.0.0.1:1", hedge_endpoints="127.0.0.1:2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lists an endpoint twice"):
        PublisherClient(hedging_settings=hedging, endpoint="127.0.0.1:1", hedge_endpoints=["a:2", "a:2"])
    with pytest.raises(ValueError, match="every endpoint must be a different target"):
        PublisherClient(hedging_settings=hedging, endpoint="127.0.0.1:1", hedge_endpoints=["127.0.0.1:1"])
    with pytest.raises(ValueError, match="empty endpoint"):
        PublisherClient(hedging_settings=hedging, endpoint="127.0.0.1:1", hedge_endpoints=[" "])


# -- real local servers --------------------------------------------------------------------------------


@pytest.fixture
def two_servers() -> Iterator[tuple[LocalServer, LocalServer]]:
    with LocalServer(in_memory=True) as primary, LocalServer(in_memory=True) as second:
        for server in (primary, second):
            with AdminClient(server.address) as admin:
                admin.create_topic(TOPIC)
        yield primary, second


def _closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _warm(publisher: PublisherClient, count: int) -> None:
    """``count`` one-message batches, one after another, to fill the token bucket."""
    for _ in range(count):
        publisher.publish(TOPIC, b"warm-up").result(timeout=10)


def test_a_hedge_to_the_second_server_escapes_a_stall_of_the_primary(
    two_servers: tuple[LocalServer, LocalServer], wait_for: Callable[..., bool]
) -> None:
    primary, second = two_servers
    hedging = HedgingSettings(hedge_delay=0.1, max_tokens=2, refill_ratio=0.2)
    with PublisherClient(
        hedging_settings=hedging,
        batch_settings=BatchSettings(max_messages=1),
        endpoint=primary.address,
        hedge_endpoints=[second.address],
    ) as publisher:
        _warm(publisher, 10)
        # The stall's origin is now, and its window lasts far longer than the test: the original is held
        # until it is cancelled, however slow the machine, and only the hedge can answer in time.
        primary.faults.seed(1)
        primary.faults.set("Publish", FaultRule(stall=StallWindows(300.0, 600.0, phase=0.0)))
        try:
            message_id = publisher.publish(TOPIC, b"escaped").result(timeout=60)
            stats = publisher.stats()
            # The original, held by the stall, was cancelled before it reached the primary's handler.
            assert wait_for(lambda: primary.faults.counts["Publish"].cancelled_during_delay == 1, timeout=30)
        finally:
            primary.faults.clear()
    assert [message.data for message in second.messages(TOPIC)] == [b"escaped"]
    assert second.messages(TOPIC)[0].message_id == message_id
    assert list(stats.endpoints) == [primary.address, second.address]
    assert stats.endpoints[second.address].wins == 1
    assert stats.endpoints[second.address].hedges_sent == 1
    assert stats.endpoints[primary.address].hedges_sent == 0
    assert [message.data for message in primary.messages(TOPIC)].count(b"escaped") == 0


def test_an_unreachable_second_endpoint_does_not_fail_the_batch(
    two_servers: tuple[LocalServer, LocalServer],
) -> None:
    primary, _ = two_servers
    unreachable = f"127.0.0.1:{_closed_port()}"
    hedging = HedgingSettings(hedge_delay=0.1, max_tokens=2, refill_ratio=0.2)
    with PublisherClient(
        hedging_settings=hedging,
        batch_settings=BatchSettings(max_messages=1),
        endpoint=primary.address,
        hedge_endpoints=[unreachable],
    ) as publisher:
        _warm(publisher, 10)
        primary.faults.set("Publish", FaultRule(latency="400ms"))
        publisher.publish(TOPIC, b"still published").result(timeout=10)
        stats = publisher.stats()
    assert stats.messages_failed == 0
    assert stats.endpoints[unreachable].hedges_sent >= 1
    assert stats.endpoints[unreachable].attempts_failed == stats.endpoints[unreachable].hedges_sent
    assert stats.endpoints[unreachable].wins == 0
    assert stats.endpoints[primary.address].wins == 11
    assert b"still published" in [message.data for message in primary.messages(TOPIC)]
