"""Replay's timers on virtual time, with the wall clock following the loop: snapshot lifetime and expiry,
and retention dropping what no rule keeps any more.

On the in-memory store only: SQLite writes finish on a thread, and virtual time jumps to the next timer
while the loop waits for them, so times would not be exact. The store operations replay relies on are
contract-tested on both stores in test_store_replay.py, and durability in test_replay.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from google.iam.v1.policy_pb2 import Binding, Policy
from google.protobuf import duration_pb2

from hedgepub.server import MemoryStore, PubSubCore, ServiceError
from hedgepub.server._pubsub.replay import PRUNE_INTERVAL_SECONDS
from hedgepub.testing.virtual_time import run_virtual

from ..._pb import PubsubMessage, Subscription, Topic

TOPIC = "projects/p/topics/events"
SUBSCRIPTION = "projects/p/subscriptions/events-sub"
SNAPSHOT = "projects/p/snapshots/events-snap"
DAY = 24 * 3600
#: The wall clock starts here (2026-01-01) and moves with the virtual loop.
EPOCH_NS = 1_767_225_600 * 1_000_000_000


def wall_ns() -> int:
    return EPOCH_NS + round(asyncio.get_running_loop().time() * 1e9)


@pytest.fixture
def make_store() -> Any:
    return MemoryStore


async def make_core(store: Any, topic: dict[str, Any] | None = None, **subscription: Any) -> PubSubCore:
    core = PubSubCore(store, wall_clock_ns=wall_ns)
    core.load()
    await core.catalog.create_topic(Topic(name=TOPIC, **(topic or {})))
    await core.catalog.create_subscription(Subscription(name=SUBSCRIPTION, topic=TOPIC, **subscription))
    return core


async def publish(core: PubSubCore, *data: bytes) -> None:
    messages = [PubsubMessage(data=item) for item in data]
    await core.publishing.publish(TOPIC, messages, sum(m.ByteSize() for m in messages))


def stored(core: PubSubCore) -> list[bytes]:
    return [message.data for message in core.messages(TOPIC)]


def test_a_snapshot_lives_7_days_less_the_age_of_its_oldest_message(make_store: Any) -> None:
    async def scenario() -> None:
        core = await make_core(
            make_store(), message_retention_duration=duration_pb2.Duration(seconds=10 * DAY)
        )
        await publish(core, b"old")
        await asyncio.sleep(3 * DAY)
        snapshot = await core.replay.create_snapshot(SNAPSHOT, SUBSCRIPTION, {})
        assert snapshot.expire_time.ToNanoseconds() == EPOCH_NS + 7 * DAY * 1_000_000_000
        await asyncio.sleep(4 * DAY - 3601)  # 7 days less 1 h 1 s after the publish
        await core.replay.create_snapshot(f"{SNAPSHOT}-2", SUBSCRIPTION, {})
        await core.catalog.set_policy(
            SNAPSHOT, Policy(bindings=[Binding(role="roles/viewer", members=["allUsers"])])
        )
        await asyncio.sleep(2)
        with pytest.raises(ServiceError) as caught:  # it would expire within the hour: refused
            await core.replay.create_snapshot(f"{SNAPSHOT}-3", SUBSCRIPTION, {})
        assert caught.value.code.name == "FAILED_PRECONDITION"
        assert "less than 1 hour" in caught.value.message
        await asyncio.sleep(3599 - 60)
        assert core.replay.get_snapshot(SNAPSHOT).name == SNAPSHOT
        await asyncio.sleep(120)
        for name in (SNAPSHOT, f"{SNAPSHOT}-2"):
            with pytest.raises(ServiceError, match="resource=events-snap"):
                core.replay.get_snapshot(name)
        assert core.policies.stored(SNAPSHOT) is None  # its IAM policy expired with it
        await core.close()

    run_virtual(scenario())


def test_an_empty_subscription_s_snapshot_lives_7_days(make_store: Any) -> None:
    async def scenario() -> None:
        core = await make_core(make_store())
        snapshot = await core.replay.create_snapshot(SNAPSHOT, SUBSCRIPTION, {})
        assert snapshot.expire_time.ToNanoseconds() == EPOCH_NS + 7 * DAY * 1_000_000_000
        # It keeps what is published after it, even once the subscription acknowledged it.
        await publish(core, b"later")
        (received,) = await core.consumers.pull(SUBSCRIPTION, 1, 0)
        await core.consumers.acknowledge(SUBSCRIPTION, [received.ack_id])
        assert stored(core) == [b"later"]
        await core.replay.delete_snapshot(SNAPSHOT)
        assert stored(core) == []
        await core.close()

    run_virtual(scenario())


def test_retention_drops_what_nothing_keeps(make_store: Any) -> None:
    async def scenario() -> None:
        core = await make_core(
            make_store(),
            topic={"message_retention_duration": duration_pb2.Duration(seconds=DAY)},
            message_retention_duration=duration_pb2.Duration(seconds=3600),
            retain_acked_messages=True,
        )
        await publish(core, b"one")
        (received,) = await core.consumers.pull(SUBSCRIPTION, 1, 0)
        await core.consumers.acknowledge(SUBSCRIPTION, [received.ack_id])
        await publish(core, b"unread")
        # Kept by the subscription's retained acknowledgements and backlog (1 h), and the topic (1 day).
        await asyncio.sleep(3600 + PRUNE_INTERVAL_SECONDS)
        assert stored(core) == [b"one", b"unread"]
        assert await core.consumers.pull(SUBSCRIPTION, 10, 0) == []  # past the subscription's retention
        await asyncio.sleep(DAY)
        assert stored(core) == []
        await core.close()

    run_virtual(scenario())


def test_retained_acknowledged_messages_go_after_the_subscription_retention(make_store: Any) -> None:
    async def scenario() -> None:
        core = await make_core(
            make_store(),
            message_retention_duration=duration_pb2.Duration(seconds=600),
            retain_acked_messages=True,
        )
        await publish(core, b"one")
        (received,) = await core.consumers.pull(SUBSCRIPTION, 1, 0)
        await core.consumers.acknowledge(SUBSCRIPTION, [received.ack_id])
        assert stored(core) == [b"one"]
        await asyncio.sleep(600 + PRUNE_INTERVAL_SECONDS + 1)
        assert stored(core) == []
        await core.replay.seek(SUBSCRIPTION, 0, None)
        assert await core.consumers.pull(SUBSCRIPTION, 10, 0) == []
        await core.close()

    run_virtual(scenario())
