"""``--dedup-hedges``: the local server stores the attempts of one hedged batch once."""

from __future__ import annotations

import asyncio
import time
import tracemalloc
from collections import Counter

import grpc
import grpc.aio
import pytest

from hedgepub import BatchSettings, HedgingSettings, PublisherClient
from hedgepub.bench import AdminClient
from hedgepub.server import FaultRule, LocalServer, StallWindows
from hedgepub.server._pubsub.hedge_dedup import HedgeBatchWindow

from ..._pb import PublishRequest, PubsubMessage
from ..conftest import aio_stub

TOPIC = "projects/dedup/topics/orders"


def _hedged_publishes_in_a_stall(server: LocalServer, count: int) -> list[str]:
    """Publish ``count`` one-message batches, each held with its hedge by one stall window."""
    with AdminClient(server.address) as admin:
        admin.create_topic(TOPIC)
    hedging = HedgingSettings(hedge_delay=0.1, max_tokens=count, refill_ratio=0.2)
    with PublisherClient(
        hedging_settings=hedging, batch_settings=BatchSettings(max_messages=1), endpoint=server.address
    ) as publisher:
        for _ in range(count * 5):  # fill the bucket
            publisher.publish(TOPIC, b"warm-up").result(timeout=10)
        ids = []
        for number in range(count):
            # Every window lasts 300 ms from now: the original and its hedge (sent at 100 ms) both wait
            # for its end and reach the handler together, so both are committed.
            server.faults.seed(number)
            server.faults.set("Publish", FaultRule(stall=StallWindows(0.3, 60.0, phase=0.0)))
            ids.append(publisher.publish(TOPIC, b"hedged-%d" % number).result(timeout=10))
            server.faults.set("Publish", None)
        assert publisher.stats().hedges_sent == count
    # A loser still on its way to the store gets there: wait until no call is in progress on the server
    # (its load shedder counts them until they end).
    deadline = time.monotonic() + 30
    while server._server.shedder.in_progress and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server._server.shedder.in_progress == 0
    return ids


def _copies(server: LocalServer) -> Counter[bytes]:
    return Counter(m.data for m in server.messages(TOPIC) if m.data.startswith(b"hedged"))


def test_hedged_copies_are_stored_once_with_dedup_hedges_and_twice_without() -> None:
    with LocalServer(in_memory=True) as plain:
        _hedged_publishes_in_a_stall(plain, 3)
        without = _copies(plain)
    with LocalServer(in_memory=True, dedup_hedges=True) as deduplicating:
        ids = _hedged_publishes_in_a_stall(deduplicating, 3)
        with_dedup = _copies(deduplicating)
        stored_ids = [m.message_id for m in deduplicating.messages(TOPIC) if m.data.startswith(b"hedged")]
        counts = deduplicating.hedge_dedup.counts  # type: ignore[union-attr]
    # The same stall makes a duplicate of every hedged batch on a plain server ...
    assert sum(without.values()) > 3, without
    # ... and none with --dedup-hedges: each batch stored once, under the ID its publisher was given.
    assert with_dedup == {b"hedged-0": 1, b"hedged-1": 1, b"hedged-2": 1}
    assert stored_ids == ids
    assert counts.answered_from_window >= 1
    assert plain.hedge_dedup is None  # off by default


async def _publish(address: str, batch_id: str | None, *data: bytes) -> list[str]:
    metadata = () if batch_id is None else (("hedgepub-batch-id", batch_id), ("hedgepub-attempt", "1"))
    async with grpc.aio.insecure_channel(address) as channel:
        publish = aio_stub(channel, "Publish")
        request = PublishRequest(topic=TOPIC, messages=[PubsubMessage(data=item) for item in data])
        return list((await publish(request, timeout=5, metadata=metadata)).message_ids)


def test_a_repeated_batch_id_gets_the_first_ids_only_for_the_same_batch() -> None:
    with LocalServer(in_memory=True, dedup_hedges=True) as server:
        with AdminClient(server.address) as admin:
            admin.create_topic(TOPIC)
        first = asyncio.run(_publish(server.address, "batch-1", b"a", b"b"))
        assert asyncio.run(_publish(server.address, "batch-1", b"a", b"b")) == first
        # A reused id with another request, no id at all, or another id: stored as usual.
        other = asyncio.run(_publish(server.address, "batch-1", b"a", b"b", b"c"))
        plain = asyncio.run(_publish(server.address, None, b"a", b"b"))
        second = asyncio.run(_publish(server.address, "batch-2", b"a", b"b"))
        assert len({*first, *other, *plain, *second}) == 9
        assert len(server.messages(TOPIC)) == 9
        counts = server.hedge_dedup.counts  # type: ignore[union-attr]
    assert (counts.stored, counts.answered_from_window) == (3, 1)


def test_concurrent_attempts_of_one_batch_are_stored_once() -> None:
    async def scenario(address: str) -> list[list[str]]:
        return await asyncio.gather(*(_publish(address, "batch-x", b"same") for _ in range(5)))

    with LocalServer(dedup_hedges=True) as server:  # SQLite: the commit awaits, so attempts overlap
        with AdminClient(server.address) as admin:
            admin.create_topic(TOPIC)
        answers = asyncio.run(scenario(server.address))
        stored = server.messages(TOPIC)
    assert len(stored) == 1
    assert answers == [[stored[0].message_id]] * 5


def test_a_failed_attempt_is_not_remembered() -> None:
    async def scenario(address: str) -> list[object]:
        attempts = (_publish(address, "batch-y", b"early") for _ in range(3))
        return await asyncio.gather(*attempts, return_exceptions=True)

    with LocalServer(dedup_hedges=True) as server:
        # No topic yet: every attempt fails on its own with NOT_FOUND, and nothing is remembered ...
        failures = asyncio.run(scenario(server.address))
        assert [error.code() for error in failures] == [grpc.StatusCode.NOT_FOUND] * 3  # type: ignore[union-attr]
        with AdminClient(server.address) as admin:
            admin.create_topic(TOPIC)
        # ... so a later attempt of that batch is stored.
        [message_id] = asyncio.run(_publish(server.address, "batch-y", b"early"))
        assert [message.message_id for message in server.messages(TOPIC)] == [message_id]


def test_a_long_batch_id_costs_what_a_short_one_costs() -> None:
    long_id = "b" * 7000  # a client's 7 KB hedgepub-batch-id, within gRPC's 8 KB metadata limit
    with LocalServer(in_memory=True, dedup_hedges=True) as server:
        with AdminClient(server.address) as admin:
            admin.create_topic(TOPIC)
        first = asyncio.run(_publish(server.address, long_id, b"a"))
        assert asyncio.run(_publish(server.address, long_id, b"a")) == first  # still deduplicated
        assert asyncio.run(_publish(server.address, long_id[:-1], b"a")) != first  # another id: stored
        counts = server.hedge_dedup.counts  # type: ignore[union-attr]
    assert (counts.stored, counts.answered_from_window, counts.batches) == (2, 1, 2)
    assert counts.remembered_bytes < 1000  # the id itself is not kept


def _remember(window: HedgeBatchWindow, batches: int, id_length: int) -> tuple[int, int]:
    """Commit ``batches`` one-message batches with ids of ``id_length`` characters; the bytes this held
    (``tracemalloc``) and how many times ``publish`` ran."""
    published = bytearray(batches)  # allocated before tracing starts

    async def scenario() -> None:
        for number in range(batches):

            async def publish(number: int = number) -> list[str]:
                published[number] = 1
                return [str(1_000_000 + number)]

            await window.publish_once(TOPIC, f"{number}-".ljust(id_length, "x"), (1, 10), publish)

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        asyncio.run(scenario())
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return held, sum(published)


def test_the_window_holds_a_few_hundred_bytes_per_batch_whatever_the_id_length() -> None:
    held, _ = _remember(HedgeBatchWindow(), 2000, 7000)
    assert held / 2000 < 1000, held  # it was 7,965 B a batch: the 7 KB id was kept


def test_the_window_is_bounded_in_bytes_oldest_forgotten_first() -> None:
    window = HedgeBatchWindow(max_bytes=100_000)
    held, published = _remember(window, 2000, 200)
    counts = window.counts
    assert 0 < counts.remembered_bytes <= 100_000
    assert held <= 100_000 * 1.2, held  # what it is charged is what it holds
    assert counts.batches < 2000 and published == 2000
    # The newest batch is still answered from the window; the oldest was forgotten and is stored again.
    assert (_remember_one(window, 1999), _remember_one(window, 0)) == (False, True)


def _remember_one(window: HedgeBatchWindow, number: int) -> bool:
    ran: list[bool] = []

    async def publish() -> list[str]:
        ran.append(True)
        return ["x"]

    asyncio.run(window.publish_once(TOPIC, f"{number}-".ljust(200, "x"), (1, 10), publish))
    return bool(ran)


def test_the_window_refuses_a_byte_bound_smaller_than_one_batch() -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        HedgeBatchWindow(max_bytes=10)
