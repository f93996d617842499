"""Ordered delivery at the service's pace, on virtual time: several messages of a key outstanding at once,
in order within and across responses, one consumer per key while any is outstanding, and a redelivery of
a key's message taking its later outstanding messages back (the dead-letter exception included)."""

from __future__ import annotations

import asyncio
from typing import Any

from hedgepub.server import MemoryStore, PubSubCore, ServiceError
from hedgepub.testing.virtual_time import run_virtual

from ..._pb import PubsubMessage, Subscription, Topic

TOPIC = "projects/p/topics/ordered"
SUBSCRIPTION = "projects/p/subscriptions/ordered-sub"
DEAD_LETTERS = "projects/p/topics/ordered-dead-letters"
DEAD_LETTER_SUBSCRIPTION = "projects/p/subscriptions/ordered-dead-letters-sub"


async def make_core(store: MemoryStore | None = None, **subscription: Any) -> PubSubCore:
    core = PubSubCore(store if store is not None else MemoryStore())
    core.load()
    await core.catalog.create_topic(Topic(name=TOPIC))
    config = Subscription(name=SUBSCRIPTION, topic=TOPIC, enable_message_ordering=True, **subscription)
    await core.catalog.create_subscription(config)
    return core


async def publish(core: PubSubCore, key: str, *data: str, **attributes: str) -> None:
    messages = [PubsubMessage(data=item.encode(), ordering_key=key, attributes=attributes) for item in data]
    await core.publishing.publish(TOPIC, messages, sum(m.ByteSize() for m in messages))


def texts(received: list[Any]) -> list[str]:
    return [r.message.data.decode() for r in received]


def test_a_hot_key_is_delivered_many_at_once_in_order_within_and_across_pull_responses() -> None:
    async def scenario() -> None:
        core = await make_core()
        await publish(core, "hot", *(f"m{i}" for i in range(10)))
        first = await core.consumers.pull(SUBSCRIPTION, 4, 0)
        second = await core.consumers.pull(SUBSCRIPTION, 4, 0)  # nothing acknowledged: the key goes on
        third = await core.consumers.pull(SUBSCRIPTION, 4, 0)
        assert texts(first + second + third) == [f"m{i}" for i in range(10)]
        assert (len(first), len(second), len(third)) == (4, 4, 2)

    run_virtual(scenario())


def test_a_nack_redelivers_the_keys_later_outstanding_messages_and_keeps_the_earlier_leased() -> None:
    async def scenario() -> None:
        core = await make_core()
        await publish(core, "k", "1", "2", "3", "4")
        await publish(core, "other", "x")
        leased = {r.message.data.decode(): r for r in await core.consumers.pull(SUBSCRIPTION, 10, 0)}
        core.consumers.modify_ack_deadline(SUBSCRIPTION, [leased["2"].ack_id], 0)
        again = await core.consumers.pull(SUBSCRIPTION, 10, 0)
        assert texts(again) == ["2", "3", "4"]  # "If message 2 is redelivered ... message 3 as well"
        # 3 and 4 were taken back: their first ack IDs no longer count; 1 and x were never touched.
        await core.consumers.acknowledge(SUBSCRIPTION, [leased["3"].ack_id, leased["4"].ack_id])
        assert core.registry.subscriptions[SUBSCRIPTION].backlog_size() == 5
        await core.consumers.acknowledge(SUBSCRIPTION, [leased["1"].ack_id, leased["x"].ack_id])
        await core.consumers.acknowledge(SUBSCRIPTION, [r.ack_id for r in again])
        assert core.is_idle()

    run_virtual(scenario())


def test_an_expired_deadline_redelivers_the_key_in_order_without_anyone_pulling() -> None:
    async def scenario() -> None:
        core = await make_core(ack_deadline_seconds=10)
        await publish(core, "k", "1", "2", "3")
        first = await core.consumers.pull(SUBSCRIPTION, 2, 0)
        second = await core.consumers.pull(SUBSCRIPTION, 2, 5.0)
        assert texts(first + second) == ["1", "2", "3"]
        await core.consumers.acknowledge(SUBSCRIPTION, [first[0].ack_id])
        await asyncio.sleep(11)  # 2 and 3 expire (3 taken back with 2 even had its deadline been later)
        again = await core.consumers.pull(SUBSCRIPTION, 10, 0)
        assert texts(again) == ["2", "3"]

    run_virtual(scenario())


def test_a_key_goes_to_one_stream_while_any_of_its_messages_is_outstanding() -> None:
    async def scenario() -> None:
        core = await make_core()
        await publish(core, "k", "1", "2")
        one = core.consumers.open_consumer(SUBSCRIPTION, 60.0, max_messages=2)
        two = core.consumers.open_consumer(SUBSCRIPTION, 60.0)
        first = await core.consumers.next_batch(SUBSCRIPTION, one)
        assert texts(first) == ["1", "2"]
        await publish(core, "k", "3")
        await publish(core, "free", "f")
        assert texts(await core.consumers.next_batch(SUBSCRIPTION, two)) == ["f"]  # not 3: stream one holds k
        waiting = asyncio.ensure_future(core.consumers.next_batch(SUBSCRIPTION, two))
        await asyncio.sleep(1)
        assert not waiting.done()
        await core.consumers.acknowledge(SUBSCRIPTION, [first[0].ack_id])
        assert texts(await core.consumers.next_batch(SUBSCRIPTION, one)) == [
            "3"
        ]  # its flow control had room for one
        await core.consumers.acknowledge(SUBSCRIPTION, [first[1].ack_id])
        await publish(core, "k", "4")
        await asyncio.sleep(1)
        assert not waiting.done()  # 3 is still outstanding on stream one
        for consumer in (one, two):
            core.consumers.close_consumer(SUBSCRIPTION, consumer)
        assert await waiting == []

    run_virtual(scenario())


def test_a_key_nobody_holds_any_more_goes_to_whichever_stream_asks() -> None:
    async def scenario() -> None:
        core = await make_core()
        await publish(core, "k", "1")
        one = core.consumers.open_consumer(SUBSCRIPTION, 60.0)
        two = core.consumers.open_consumer(SUBSCRIPTION, 60.0)
        (first,) = await core.consumers.next_batch(SUBSCRIPTION, one)
        await core.consumers.acknowledge(SUBSCRIPTION, [first.ack_id])
        await publish(core, "k", "2")
        assert texts(await core.consumers.next_batch(SUBSCRIPTION, two)) == ["2"]

    run_virtual(scenario())


def test_taken_back_messages_count_no_delivery_attempt_and_the_nacked_one_does() -> None:
    async def scenario() -> None:
        core = PubSubCore(MemoryStore())
        core.load()
        await core.catalog.create_topic(Topic(name=TOPIC))
        await core.catalog.create_topic(Topic(name=DEAD_LETTERS))
        await core.catalog.create_subscription(
            Subscription(name=DEAD_LETTER_SUBSCRIPTION, topic=DEAD_LETTERS)
        )
        config = Subscription(name=SUBSCRIPTION, topic=TOPIC, enable_message_ordering=True)
        config.dead_letter_policy.dead_letter_topic = DEAD_LETTERS
        config.dead_letter_policy.max_delivery_attempts = 5
        await core.catalog.create_subscription(config)
        await publish(core, "k", "poison", "next", "last")
        attempts = []
        for _ in range(4):
            batch = await core.consumers.pull(SUBSCRIPTION, 10, 0)
            assert texts(batch) == ["poison", "next", "last"]
            attempts.append([r.delivery_attempt for r in batch])
            core.consumers.modify_ack_deadline(SUBSCRIPTION, [batch[0].ack_id], 0)
        assert attempts == [[1, 1, 1], [2, 1, 1], [3, 1, 1], [4, 1, 1]]
        fifth = await core.consumers.pull(SUBSCRIPTION, 10, 0)
        assert [r.delivery_attempt for r in fifth] == [5, 1, 1]
        # The fifth nack forwards "poison": the dead-letter exception, "next" and "last" keep their leases
        # (no redelivery) and are acknowledged under the ack IDs they have.
        core.consumers.modify_ack_deadline(SUBSCRIPTION, [fifth[0].ack_id], 0)
        (forwarded,) = await core.consumers.pull(DEAD_LETTER_SUBSCRIPTION, 1, 5.0)
        assert forwarded.message.data == b"poison"
        assert await core.consumers.pull(SUBSCRIPTION, 10, 0) == []
        await core.consumers.acknowledge(SUBSCRIPTION, [r.ack_id for r in fifth[1:]])
        assert core.registry.subscriptions[SUBSCRIPTION].backlog_size() == 0
        await publish(core, "k", "after")
        assert texts(await core.consumers.pull(SUBSCRIPTION, 10, 0)) == ["after"]

    run_virtual(scenario())


def test_exactly_once_withdrawn_ack_ids_fail_and_their_leases_are_not_restored() -> None:
    async def scenario() -> None:
        store = MemoryStore()
        core = await make_core(store, enable_exactly_once_delivery=True, ack_deadline_seconds=60)
        await publish(core, "k", "1", "2", "3")
        first = await core.consumers.pull(SUBSCRIPTION, 10, 0)
        core.consumers.modify_ack_deadline(
            SUBSCRIPTION, [first[0].ack_id], 0
        )  # 2 and 3 are taken back with 1
        try:
            await core.consumers.acknowledge(SUBSCRIPTION, [first[2].ack_id])
        except ServiceError as failure:
            (info,) = failure.details
            assert info.metadata == {first[2].ack_id: "PERMANENT_FAILURE_INVALID_ACK_ID"}
        else:
            raise AssertionError("a withdrawn ack ID was accepted on an exactly-once subscription")
        await asyncio.sleep(0.01)  # the background lease writes
        assert store.leases(SUBSCRIPTION) == []
        await core.close()

        core = PubSubCore(store)  # a restart: nothing of the key is restored ahead of 1
        core.load()
        assert texts(await core.consumers.pull(SUBSCRIPTION, 10, 0)) == ["1", "2", "3"]

    run_virtual(scenario())


def test_an_exactly_once_lease_restored_after_a_restart_holds_its_key() -> None:
    async def scenario() -> None:
        store = MemoryStore()
        core = await make_core(store, enable_exactly_once_delivery=True, ack_deadline_seconds=60)
        await publish(core, "k", "1", "2")
        (held, second) = await core.consumers.pull(SUBSCRIPTION, 10, 0)
        await core.consumers.acknowledge(SUBSCRIPTION, [second.ack_id])  # out of order: 2 is done, 1 is not
        await core.close()

        core = PubSubCore(store)
        core.load()
        await publish(core, "k", "3")
        assert await core.consumers.pull(SUBSCRIPTION, 10, 0) == []  # 1 still leased: 3 waits behind it
        await core.consumers.acknowledge(SUBSCRIPTION, [held.ack_id])
        assert texts(await core.consumers.pull(SUBSCRIPTION, 10, 0)) == ["3"]

    run_virtual(scenario())


def test_a_filter_still_applies_on_an_ordered_subscription() -> None:
    async def scenario() -> None:
        core = await make_core(filter='attributes.kind = "keep"')
        await publish(core, "k", "1", "2", kind="keep")
        await publish(core, "k", "dropped", kind="drop")
        await publish(core, "k", "3", kind="keep")
        batch = await core.consumers.pull(SUBSCRIPTION, 10, 0)
        assert texts(batch) == ["1", "2", "3"]
        await core.consumers.acknowledge(SUBSCRIPTION, [r.ack_id for r in batch])
        assert core.is_idle()

    run_virtual(scenario())


def test_a_window_of_held_keys_refills_in_order() -> None:
    async def scenario() -> None:
        core = PubSubCore(MemoryStore(), window=5)
        core.load()
        await core.catalog.create_topic(Topic(name=TOPIC))
        await core.catalog.create_subscription(
            Subscription(name=SUBSCRIPTION, topic=TOPIC, enable_message_ordering=True)
        )
        for i in range(30):
            await publish(core, f"k{i % 3}", f"{i}")
        consumer = core.consumers.open_consumer(SUBSCRIPTION, 600.0, max_messages=7)
        seen: dict[str, list[int]] = {"k0": [], "k1": [], "k2": []}
        nacked = False
        while sum(map(len, seen.values())) < 30:
            batch = await core.consumers.next_batch(SUBSCRIPTION, consumer)
            if not nacked:  # one redelivery midway: the key's later messages come back after it
                nacked = True
                core.consumers.modify_ack_deadline(SUBSCRIPTION, [batch[0].ack_id], 0)
                batch = [r for r in batch if r.message.ordering_key != batch[0].message.ordering_key]
            for r in batch:
                seen[r.message.ordering_key].append(int(r.message.data))
            await core.consumers.acknowledge(SUBSCRIPTION, [r.ack_id for r in batch])
        assert seen == {f"k{k}": list(range(k, 30, 3)) for k in range(3)}
        core.consumers.close_consumer(SUBSCRIPTION, consumer)

    run_virtual(scenario())


def test_leases_a_crash_left_recorded_ahead_of_their_key_still_end_in_order() -> None:
    """A crash between a nack and the background write that forgets the withdrawn leases leaves them
    recorded: restored after the restart, they hold the key until they run out, and then the key comes
    again in order, the nacked message first."""

    async def scenario() -> None:
        store = MemoryStore()
        core = await make_core(store, enable_exactly_once_delivery=True, ack_deadline_seconds=60)
        await publish(core, "k", "1", "2", "3")
        first = await core.consumers.pull(SUBSCRIPTION, 10, 0)
        recorded = [row for row in store.leases(SUBSCRIPTION) if row[0] != store.leases(SUBSCRIPTION)[0][0]]
        core.consumers.modify_ack_deadline(SUBSCRIPTION, [first[0].ack_id], 0)
        await asyncio.sleep(0.01)
        await store.put_leases(SUBSCRIPTION, recorded)  # what the crash would have left of 2 and 3
        await core.close()

        core = PubSubCore(store)
        core.load()
        assert await core.consumers.pull(SUBSCRIPTION, 10, 0) == []  # 2 and 3 hold the key
        again = await core.consumers.pull(SUBSCRIPTION, 10, 90.0)  # until their deadlines pass
        assert texts(again) == ["1", "2", "3"]

    run_virtual(scenario())
