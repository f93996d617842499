"""Delivery semantics of the core, on virtual time: deadlines, nacks, ordering, dead letters, flow control."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from hedgepub.server import MemoryStore, PubSubCore, ServiceError
from hedgepub.testing.virtual_time import run_virtual

from ..._pb import PubsubMessage, PullResponse, Subscription, Topic

TOPIC = "projects/p/topics/events"
SUBSCRIPTION = "projects/p/subscriptions/events-sub"
DEAD_LETTERS = "projects/p/topics/dead-letters"


async def make_core(**subscription: Any) -> PubSubCore:
    core = PubSubCore(MemoryStore())
    core.load()
    await core.catalog.create_topic(Topic(name=TOPIC))
    await core.catalog.create_subscription(Subscription(name=SUBSCRIPTION, topic=TOPIC, **subscription))
    return core


async def publish(core: PubSubCore, *data: bytes, key: str = "") -> list[str]:
    messages = [PubsubMessage(data=item, ordering_key=key) for item in data]
    return await core.publishing.publish(TOPIC, messages, sum(m.ByteSize() for m in messages))


def now() -> float:
    return asyncio.get_running_loop().time()


def test_lease_expiry_redelivers_with_a_new_ack_id_without_anyone_pulling() -> None:
    async def scenario() -> None:
        core = await make_core()
        await publish(core, b"one")
        first = await core.consumers.pull(SUBSCRIPTION, 10, 0)
        assert [r.message.data for r in first] == [b"one"]
        # A streaming consumer waits; only the timer can hand it the message back.
        consumer = core.consumers.open_consumer(SUBSCRIPTION, 10.0)
        again = await core.consumers.next_batch(SUBSCRIPTION, consumer)
        assert 10.0 <= now() < 10.1
        assert again[0].message.message_id == first[0].message.message_id
        assert again[0].ack_id != first[0].ack_id

    run_virtual(scenario())


def test_a_waiting_pull_gets_a_message_that_returns_just_after_it_found_none() -> None:
    """Regression: a message made ready one loop step after a waiting Pull found nothing was missed.

    The Pull then slept its whole wait and answered empty (seen as a dead-letter Pull coming back empty).
    """

    async def scenario() -> None:
        core = await make_core()
        await publish(core, b"one")
        (lease,) = await core.consumers.pull(SUBSCRIPTION, 1, 0)
        waiting = asyncio.ensure_future(core.consumers.pull(SUBSCRIPTION, 1, 5.0))
        # Queued before the Pull runs, so the nack lands in the step right after the Pull found nothing.
        asyncio.get_running_loop().call_soon(
            core.consumers.modify_ack_deadline, SUBSCRIPTION, [lease.ack_id], 0
        )
        received = await waiting
        assert [r.message.data for r in received] == [b"one"]
        assert now() == 0.0

    run_virtual(scenario())


def test_a_message_older_than_the_retention_is_not_delivered() -> None:
    async def scenario() -> None:
        store = MemoryStore()
        core = PubSubCore(store)
        core.load()
        await core.catalog.create_topic(Topic(name=TOPIC))
        config = Subscription(name=SUBSCRIPTION, topic=TOPIC)
        config.message_retention_duration.seconds = 600
        await core.catalog.create_subscription(config)
        await publish(core, b"old")
        published = core.wall_clock_ns()
        core.wall_clock_ns = lambda: published + 599 * 10**9
        await publish(core, b"new")
        core.wall_clock_ns = lambda: published + 601 * 10**9  # "old" is now past 10 minutes
        assert [r.message.data for r in await core.consumers.pull(SUBSCRIPTION, 10, 0)] == [b"new"]
        await asyncio.sleep(0)  # the expired message's removal from the store
        assert [message.data for _, message in store.pending(SUBSCRIPTION, 0, 100)] == [b"new"]

    run_virtual(scenario())


def test_modify_ack_deadline_extends_and_zero_nacks() -> None:
    async def scenario() -> None:
        core = await make_core(ack_deadline_seconds=10)
        await publish(core, b"one")
        (lease,) = await core.consumers.pull(SUBSCRIPTION, 10, 0)
        core.consumers.modify_ack_deadline(SUBSCRIPTION, [lease.ack_id], 60)
        await asyncio.sleep(30)
        assert await core.consumers.pull(SUBSCRIPTION, 10, 0) == []
        core.consumers.modify_ack_deadline(SUBSCRIPTION, [lease.ack_id], 0)
        (again,) = await core.consumers.pull(SUBSCRIPTION, 10, 0)
        assert again.message.data == b"one"
        assert now() == 30.0

    run_virtual(scenario())


def test_acknowledged_messages_never_come_back_and_late_acks_are_ignored() -> None:
    async def scenario() -> None:
        core = await make_core()
        await publish(core, b"one", b"two")
        leases = await core.consumers.pull(SUBSCRIPTION, 10, 0)
        await core.consumers.acknowledge(SUBSCRIPTION, [leases[0].ack_id])
        await asyncio.sleep(11)  # the second lease expires
        (again,) = await core.consumers.pull(SUBSCRIPTION, 10, 0)
        assert again.message.data == b"two"
        await core.consumers.acknowledge(SUBSCRIPTION, [leases[1].ack_id])  # expired ack ID: ignored
        await core.consumers.acknowledge(SUBSCRIPTION, [again.ack_id])
        await asyncio.sleep(100)
        assert await core.consumers.pull(SUBSCRIPTION, 10, 0) == []
        assert core.is_idle()

    run_virtual(scenario())


def test_pull_waits_for_a_message_and_answers_empty_after_its_wait() -> None:
    async def scenario() -> None:
        core = await make_core()
        assert await core.consumers.pull(SUBSCRIPTION, 10, 5.0) == []
        assert now() == pytest.approx(5.0)
        waiting = asyncio.ensure_future(core.consumers.pull(SUBSCRIPTION, 10, 5.0))
        await asyncio.sleep(1)
        await publish(core, b"late")
        assert [r.message.data for r in await waiting] == [b"late"]

    run_virtual(scenario())


def test_ordered_subscription_delivers_a_key_in_order_and_a_nack_takes_the_later_ones_back() -> None:
    async def scenario() -> None:
        core = await make_core(enable_message_ordering=True)
        await publish(core, b"a1", b"a2", b"a3", key="a")
        await publish(core, b"b1", b"b2", key="b")
        await publish(core, b"free")
        first = await core.consumers.pull(SUBSCRIPTION, 10, 0)
        assert [r.message.data for r in first] == [b"a1", b"a2", b"a3", b"b1", b"b2", b"free"]
        by_data = {r.message.data: r for r in first}
        # A nack of a2 redelivers a3 as well (its lease ends); a1 stays leased, the key b untouched.
        core.consumers.modify_ack_deadline(SUBSCRIPTION, [by_data[b"a2"].ack_id], 0)
        again = await core.consumers.pull(SUBSCRIPTION, 10, 0)
        assert [r.message.data for r in again] == [b"a2", b"a3"]
        await core.consumers.acknowledge(
            SUBSCRIPTION, [by_data[b"a3"].ack_id]
        )  # the withdrawn lease: ignored
        await core.consumers.acknowledge(SUBSCRIPTION, [by_data[b"a1"].ack_id, *(r.ack_id for r in again)])
        await core.consumers.acknowledge(SUBSCRIPTION, [by_data[b"b1"].ack_id, by_data[b"b2"].ack_id])
        await core.consumers.acknowledge(SUBSCRIPTION, [by_data[b"free"].ack_id])
        assert await core.consumers.pull(SUBSCRIPTION, 10, 0) == []
        assert core.is_idle()

    run_virtual(scenario())


def test_unordered_subscription_ignores_ordering_keys() -> None:
    async def scenario() -> None:
        core = await make_core()
        await publish(core, b"a1", b"a2", key="a")
        assert len(await core.consumers.pull(SUBSCRIPTION, 10, 0)) == 2

    run_virtual(scenario())


def test_dead_letter_policy_counts_attempts_then_forwards() -> None:
    async def scenario() -> None:
        core = PubSubCore(MemoryStore())
        core.load()
        await core.catalog.create_topic(Topic(name=TOPIC))
        await core.catalog.create_topic(Topic(name=DEAD_LETTERS))
        await core.catalog.create_subscription(
            Subscription(name="projects/p/subscriptions/dlq-sub", topic=DEAD_LETTERS)
        )
        config = Subscription(name=SUBSCRIPTION, topic=TOPIC)
        config.dead_letter_policy.dead_letter_topic = DEAD_LETTERS
        config.dead_letter_policy.max_delivery_attempts = 5
        await core.catalog.create_subscription(config)
        await publish(core, b"poison")
        attempts = []
        for _ in range(5):
            (lease,) = await core.consumers.pull(SUBSCRIPTION, 1, 0)
            attempts.append(lease.delivery_attempt)
            core.consumers.modify_ack_deadline(SUBSCRIPTION, [lease.ack_id], 0)
        assert attempts == [1, 2, 3, 4, 5]
        assert await core.consumers.pull(SUBSCRIPTION, 1, 0) == []
        await asyncio.sleep(0.01)  # the forwarding task
        (forwarded,) = await core.consumers.pull("projects/p/subscriptions/dlq-sub", 1, 0)
        assert forwarded.message.data == b"poison"
        assert forwarded.message.attributes["CloudPubSubDeadLetterSourceDeliveryCount"] == "5"
        assert forwarded.delivery_attempt == 0  # no dead-letter policy there: not counted
        assert core.is_idle() is False  # the forwarded message is leased on the dead-letter subscription

    run_virtual(scenario())


DEAD_LETTER_SUBSCRIPTION = "projects/p/subscriptions/dlq-sub"


class FailingStore(MemoryStore):
    """A real in-memory store whose writes to the named topics or subscriptions fail (a full disk, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.failing: set[str] = set()

    async def append(self, batch: Any, subscriptions: Any) -> None:
        if batch.topic in self.failing:
            raise OSError(f"disk full while appending to {batch.topic}")
        await super().append(batch, subscriptions)

    async def ack(self, subscription: str, sequences: Any) -> None:
        if subscription in self.failing:
            raise OSError(f"disk full while acknowledging on {subscription}")
        await super().ack(subscription, sequences)


async def make_dead_letter_core(store: MemoryStore | None = None) -> PubSubCore:
    """Subscription -> dead-letter topic after 5 attempts; a plain subscription on the dead-letter topic."""
    core = PubSubCore(store if store is not None else MemoryStore())
    core.load()
    await core.catalog.create_topic(Topic(name=TOPIC))
    await core.catalog.create_topic(Topic(name=DEAD_LETTERS))
    await core.catalog.create_subscription(Subscription(name=DEAD_LETTER_SUBSCRIPTION, topic=DEAD_LETTERS))
    config = Subscription(name=SUBSCRIPTION, topic=TOPIC, ack_deadline_seconds=10)
    config.dead_letter_policy.dead_letter_topic = DEAD_LETTERS
    config.dead_letter_policy.max_delivery_attempts = 5
    await core.catalog.create_subscription(config)
    return core


async def use_up_attempts(core: PubSubCore, nack_last: bool = True) -> None:
    """Deliver the one message 5 times, nacking each (the last one too, unless ``nack_last`` is False)."""
    for attempt in range(1, 6):
        (lease,) = await core.consumers.pull(SUBSCRIPTION, 1, 0)
        assert lease.delivery_attempt == attempt
        if attempt < 5 or nack_last:
            core.consumers.modify_ack_deadline(SUBSCRIPTION, [lease.ack_id], 0)


def test_dead_lettering_happens_at_the_last_nack_without_anyone_pulling_the_source() -> None:
    async def scenario() -> None:
        store = MemoryStore()
        core = await make_dead_letter_core(store)
        await publish(core, b"poison")
        await use_up_attempts(core)
        # Nobody pulls SUBSCRIPTION again: a waiting Pull on the dead-letter subscription gets the copy.
        (forwarded,) = await core.consumers.pull(DEAD_LETTER_SUBSCRIPTION, 1, 5.0)
        assert now() == 0.0
        assert forwarded.message.data == b"poison"
        assert forwarded.message.attributes["CloudPubSubDeadLetterSourceDeliveryCount"] == "5"
        assert store.pending(SUBSCRIPTION, 0, 100) == []  # acknowledged on the source, durably

    run_virtual(scenario())


def test_dead_lettering_happens_when_the_last_deadline_passes() -> None:
    async def scenario() -> None:
        core = await make_dead_letter_core()
        await publish(core, b"poison")
        await use_up_attempts(core, nack_last=False)
        (forwarded,) = await core.consumers.pull(DEAD_LETTER_SUBSCRIPTION, 1, 60.0)
        assert 10.0 <= now() < 10.1  # the fifth lease's 10 s deadline
        assert forwarded.message.attributes["CloudPubSubDeadLetterSourceDeliveryCount"] == "5"
        assert await core.consumers.pull(SUBSCRIPTION, 1, 0) == []

    run_virtual(scenario())


def test_a_failed_dead_letter_forwarding_keeps_the_message_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        store = FailingStore()
        core = await make_dead_letter_core(store)
        await publish(core, b"poison")
        store.failing.add(DEAD_LETTERS)
        await use_up_attempts(core)
        (again,) = await core.consumers.pull(SUBSCRIPTION, 1, 5.0)  # back on the source, not dropped
        assert again.message.data == b"poison" and again.delivery_attempt == 6
        assert store.messages(DEAD_LETTERS) == []
        assert [sequence for sequence, _ in store.pending(SUBSCRIPTION, 0, 100)] == [1]  # still durable
        # The next nack tries again, and now the store takes it.
        store.failing.clear()
        core.consumers.modify_ack_deadline(SUBSCRIPTION, [again.ack_id], 0)
        (forwarded,) = await core.consumers.pull(DEAD_LETTER_SUBSCRIPTION, 1, 5.0)
        assert forwarded.message.attributes["CloudPubSubDeadLetterSourceDeliveryCount"] == "6"
        assert store.pending(SUBSCRIPTION, 0, 100) == []

    with caplog.at_level("ERROR", logger="hedgepub.server"):
        run_virtual(scenario())
    assert "dead-letter topic projects/p/topics/dead-letters failed" in caplog.text


def test_ended_deliveries_are_counted_in_the_store_and_read_back_by_a_new_core() -> None:
    """Nacks and passed deadlines are recorded (one write per loop step); a core loaded on the same store,
    as after a restart, delivers with the count it left off at, and dead-letters at the limit."""

    async def scenario() -> None:
        store = MemoryStore()
        core = await make_dead_letter_core(store)
        await publish(core, b"poison", b"fine")
        first, other = await core.consumers.pull(SUBSCRIPTION, 2, 0)
        assert (first.delivery_attempt, other.delivery_attempt) == (1, 1)
        core.consumers.modify_ack_deadline(SUBSCRIPTION, [first.ack_id], 0)
        await core.consumers.acknowledge(SUBSCRIPTION, [other.ack_id])
        await core.consumers.attempts_recorded()
        assert store.attempts(SUBSCRIPTION, 0, 10) == {1: 1}
        (second,) = await core.consumers.pull(SUBSCRIPTION, 1, 0)
        assert second.delivery_attempt == 2
        await asyncio.sleep(10.5)  # its 10 s deadline passes
        await core.consumers.attempts_recorded()
        assert store.attempts(SUBSCRIPTION, 0, 10) == {1: 2}
        await core.close()

        core = PubSubCore(store)  # the store outlives the core: what a restart does to SQLite
        core.load()
        for attempt in (3, 4, 5):
            (lease,) = await core.consumers.pull(SUBSCRIPTION, 1, 0)
            assert lease.message.data == b"poison" and lease.delivery_attempt == attempt
            core.consumers.modify_ack_deadline(SUBSCRIPTION, [lease.ack_id], 0)
        (forwarded,) = await core.consumers.pull(DEAD_LETTER_SUBSCRIPTION, 1, 5.0)
        assert forwarded.message.attributes["CloudPubSubDeadLetterSourceDeliveryCount"] == "5"
        assert store.pending(SUBSCRIPTION, 0, 10) == []

    run_virtual(scenario())


def test_an_exactly_once_lease_restored_after_a_restart_keeps_its_delivery_count() -> None:
    async def scenario() -> None:
        store = MemoryStore()
        core = await make_dead_letter_core(store)
        config = core.catalog.get_subscription(SUBSCRIPTION)
        config.enable_exactly_once_delivery = True
        await core.catalog.update_subscription(config, ["enable_exactly_once_delivery"])
        await publish(core, b"poison")
        for attempt in (1, 2):
            (lease,) = await core.consumers.pull(SUBSCRIPTION, 1, 0)
            assert lease.delivery_attempt == attempt
            core.consumers.modify_ack_deadline(SUBSCRIPTION, [lease.ack_id], 0)
        (held,) = await core.consumers.pull(SUBSCRIPTION, 1, 0)  # the third delivery, leased over the restart
        await core.close()

        core = PubSubCore(store)
        core.load()  # the lease holds again: the third delivery, not a first one
        assert await core.consumers.pull(SUBSCRIPTION, 1, 0) == []
        core.consumers.modify_ack_deadline(SUBSCRIPTION, [held.ack_id], 0)
        (again,) = await core.consumers.pull(SUBSCRIPTION, 1, 0)
        assert again.delivery_attempt == 4

    run_virtual(scenario())


def test_the_dead_letter_copy_is_stored_before_the_source_ack(caplog: pytest.LogCaptureFixture) -> None:
    """A failure between the two writes can only duplicate the message, never lose it."""

    async def scenario() -> None:
        store = FailingStore()
        core = await make_dead_letter_core(store)
        await publish(core, b"poison")
        store.failing.add(SUBSCRIPTION)  # the source ack fails, after the copy was stored
        await use_up_attempts(core)
        (copy,) = await core.consumers.pull(DEAD_LETTER_SUBSCRIPTION, 1, 5.0)
        (again,) = await core.consumers.pull(SUBSCRIPTION, 1, 5.0)
        assert copy.message.data == again.message.data == b"poison"

    with caplog.at_level("ERROR", logger="hedgepub.server"):
        run_virtual(scenario())
    assert "disk full while acknowledging" in caplog.text


def test_streaming_flow_control_limits_outstanding_messages() -> None:
    async def scenario() -> None:
        core = await make_core()
        await publish(core, *[f"m{i}".encode() for i in range(5)])
        consumer = core.consumers.open_consumer(SUBSCRIPTION, 60.0, max_messages=2)
        first = await core.consumers.next_batch(SUBSCRIPTION, consumer)
        assert len(first) == 2
        blocked = asyncio.ensure_future(core.consumers.next_batch(SUBSCRIPTION, consumer))
        await asyncio.sleep(1)
        assert not blocked.done()
        await core.consumers.acknowledge(SUBSCRIPTION, [first[0].ack_id])
        assert len(await blocked) == 1
        core.consumers.close_consumer(SUBSCRIPTION, consumer)
        assert await core.consumers.next_batch(SUBSCRIPTION, consumer) == []

    run_virtual(scenario())


def test_messages_published_before_a_subscription_exists_are_not_delivered_to_it() -> None:
    async def scenario() -> None:
        core = await make_core()
        await publish(core, b"early")
        await core.catalog.create_subscription(
            Subscription(name="projects/p/subscriptions/late", topic=TOPIC)
        )
        assert await core.consumers.pull("projects/p/subscriptions/late", 10, 0) == []
        assert len(await core.consumers.pull(SUBSCRIPTION, 10, 0)) == 1

    run_virtual(scenario())


def test_deleting_a_subscription_ends_its_waiting_consumers() -> None:
    async def scenario() -> None:
        core = await make_core()
        consumer = core.consumers.open_consumer(SUBSCRIPTION, 10.0)
        waiting = asyncio.ensure_future(core.consumers.next_batch(SUBSCRIPTION, consumer))
        await asyncio.sleep(0)
        await core.catalog.delete_subscription(SUBSCRIPTION)
        with pytest.raises(ServiceError, match="Resource not found"):
            await waiting

    run_virtual(scenario())


def test_a_subscription_holds_a_bounded_window_and_reads_the_rest_of_its_backlog_in_order() -> None:
    async def scenario() -> None:
        store = MemoryStore()
        core = PubSubCore(store, window=50)
        core.load()
        await core.catalog.create_topic(Topic(name=TOPIC))
        await core.catalog.create_subscription(Subscription(name=SUBSCRIPTION, topic=TOPIC))
        for start in range(0, 1000, 100):
            await publish(core, *(f"m{i}".encode() for i in range(start, start + 100)))
        state = core.registry.subscriptions[SUBSCRIPTION]
        assert state.held() == 50  # the other 950 are only in the store
        received: list[bytes] = []
        while batch := await core.consumers.pull(SUBSCRIPTION, 30, 0):
            assert state.held() <= 50
            received.extend(r.message.data for r in batch)
            await core.consumers.acknowledge(SUBSCRIPTION, [r.ack_id for r in batch])
        assert received == [f"m{i}".encode() for i in range(1000)]
        assert core.is_idle() and store.messages(TOPIC) == []  # acknowledged messages leave the store

    run_virtual(scenario())


def test_an_ordered_subscription_keeps_key_order_across_pages() -> None:
    async def scenario() -> None:
        core = PubSubCore(MemoryStore(), window=4)
        core.load()
        await core.catalog.create_topic(Topic(name=TOPIC))
        await core.catalog.create_subscription(
            Subscription(name=SUBSCRIPTION, topic=TOPIC, enable_message_ordering=True)
        )
        for i in range(10):
            await publish(core, f"a{i}".encode(), key="a")
            await publish(core, f"b{i}".encode(), key="b")
        seen: dict[str, list[int]] = {"a": [], "b": []}
        while batch := await core.consumers.pull(SUBSCRIPTION, 3, 0):
            for r in batch:
                seen[r.message.ordering_key].append(int(r.message.data[1:]))
            await core.consumers.acknowledge(SUBSCRIPTION, [r.ack_id for r in batch])
        assert seen == {"a": list(range(10)), "b": list(range(10))}

    run_virtual(scenario())


def test_a_modify_ack_deadline_loop_leaves_the_deadline_heap_bounded() -> None:
    async def scenario() -> None:
        core = await make_core()
        await publish(core, *(f"m{i}".encode() for i in range(10)))
        leases = await core.consumers.pull(SUBSCRIPTION, 10, 0)
        ack_ids = [r.ack_id for r in leases]
        for _ in range(2000):
            core.consumers.modify_ack_deadline(SUBSCRIPTION, ack_ids, 60)
        assert core.consumers.leasing.heap_size() <= 2 * 10 + 1024 + 1
        await core.consumers.acknowledge(SUBSCRIPTION, ack_ids)
        for _ in range(2000):  # acknowledged: nothing to extend, nothing added
            core.consumers.modify_ack_deadline(SUBSCRIPTION, ack_ids, 60)
        assert core.consumers.leasing.heap_size() <= 1024 + 1

    run_virtual(scenario())


def test_pull_responses_stay_under_four_mebibytes_and_a_larger_message_goes_alone() -> None:
    from hedgepub.server._pubsub.delivery import MAX_RESPONSE_BYTES

    async def scenario() -> None:
        core = await make_core()
        for _ in range(4):
            await publish(core, *([b"x" * 5000] * 500))
        sizes = []
        while batch := await core.consumers.pull(SUBSCRIPTION, 1000, 0):
            response = PullResponse(received_messages=batch)
            sizes.append(response.ByteSize())
            await core.consumers.acknowledge(SUBSCRIPTION, [r.ack_id for r in batch])
        assert max(sizes) <= MAX_RESPONSE_BYTES < 4 * 1024 * 1024 and len(sizes) >= 3
        big = b"y" * (limits_max := 5 * 1024 * 1024)
        await publish(core, big, b"small")
        (alone,) = await core.consumers.pull(SUBSCRIPTION, 10, 0)
        assert len(alone.message.data) == limits_max
        (after,) = await core.consumers.pull(SUBSCRIPTION, 10, 0)
        assert after.message.data == b"small"

    run_virtual(scenario())
