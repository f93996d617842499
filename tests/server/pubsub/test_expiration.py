"""Subscription expiration on virtual time: inactive for the ttl, a subscription is deleted; activity
(pull, an open stream, ack, modack, update) keeps it; a policy without ttl never expires.

Virtual time stays under 90 days here: past about 2**23 s the loop's clock resolution (1e-9 s) is below
the spacing of floats, and asyncio's run loop stops running timers that are due exactly now."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from google.protobuf import duration_pb2

from hedgepub.server import MemoryStore, PubSubCore, ServiceError
from hedgepub.testing.virtual_time import run_virtual

from ..._pb import ExpirationPolicy, PubsubMessage, Subscription, Topic

TOPIC = "projects/p/topics/events"
SUBSCRIPTION = "projects/p/subscriptions/events-sub"
DAY = 24 * 3600.0


async def make_core(policy: Any | None) -> PubSubCore:
    core = PubSubCore(MemoryStore())
    core.load()
    await core.catalog.create_topic(Topic(name=TOPIC))
    subscription = Subscription(name=SUBSCRIPTION, topic=TOPIC)
    if policy is not None:
        subscription.expiration_policy.CopyFrom(policy)
    await core.catalog.create_subscription(subscription)
    return core


def ttl(days: float) -> Any:
    return ExpirationPolicy(ttl=duration_pb2.Duration(seconds=int(days * DAY)))


def exists(core: PubSubCore) -> bool:
    try:
        core.catalog.get_subscription(SUBSCRIPTION)
    except ServiceError:
        return False
    return True


async def sleep_until(moment: float) -> None:
    await asyncio.sleep(moment - asyncio.get_running_loop().time())


def test_an_inactive_subscription_is_deleted_after_its_ttl() -> None:
    async def scenario() -> None:
        core = await make_core(ttl(1))
        await sleep_until(DAY - 1)
        assert exists(core)
        await sleep_until(DAY + 1)
        assert not exists(core)
        assert core.catalog.list_topic_subscriptions(TOPIC, 0, "")[0] == []

    run_virtual(scenario())


def test_the_default_policy_expires_after_31_days() -> None:
    async def scenario() -> None:
        core = await make_core(None)
        await sleep_until(31 * DAY - 10)
        assert exists(core)
        await sleep_until(31 * DAY + 10)
        assert not exists(core)

    run_virtual(scenario())


def test_a_policy_without_ttl_never_expires() -> None:
    async def scenario() -> None:
        core = await make_core(ExpirationPolicy())
        await sleep_until(60 * DAY)
        assert exists(core)

    run_virtual(scenario())


@pytest.mark.parametrize("activity", ["pull", "ack", "modack"])
def test_activity_restarts_the_ttl(activity: str) -> None:
    async def scenario() -> None:
        core = await make_core(ttl(1))
        await core.publishing.publish(TOPIC, [PubsubMessage(data=b"x")], 10)
        await sleep_until(DAY - 100)
        if activity == "pull":
            await core.consumers.pull(SUBSCRIPTION, 1, 0)
        elif activity == "ack":
            await core.consumers.acknowledge(SUBSCRIPTION, ["abcdef01-1"])
        else:
            core.consumers.modify_ack_deadline(SUBSCRIPTION, ["abcdef01-1"], 30)
        await sleep_until(2 * DAY - 200)
        assert exists(core)
        await sleep_until(2 * DAY)
        assert not exists(core)

    run_virtual(scenario())


def test_an_open_stream_keeps_the_subscription_and_its_close_restarts_the_ttl() -> None:
    async def scenario() -> None:
        core = await make_core(ttl(1))
        consumer = core.consumers.open_consumer(SUBSCRIPTION, 10.0)
        await sleep_until(5 * DAY)
        assert exists(core)
        core.consumers.close_consumer(SUBSCRIPTION, consumer)
        core.consumers.close_consumer(SUBSCRIPTION, consumer)  # the service closes a stream from two places
        await sleep_until(6 * DAY - 10)
        assert exists(core)
        await sleep_until(6 * DAY + 10)
        assert not exists(core)

    run_virtual(scenario())


def test_an_update_can_turn_expiration_off() -> None:
    async def scenario() -> None:
        core = await make_core(ttl(1))
        await sleep_until(DAY / 2)
        update = Subscription(name=SUBSCRIPTION, expiration_policy=ExpirationPolicy())
        await core.catalog.update_subscription(update, ["expiration_policy"])
        await sleep_until(60 * DAY)
        assert exists(core)

    run_virtual(scenario())


def test_a_deleted_and_recreated_subscription_starts_a_new_ttl() -> None:
    async def scenario() -> None:
        core = await make_core(ttl(1))
        await sleep_until(DAY / 2)
        await core.catalog.delete_subscription(SUBSCRIPTION)
        await core.catalog.create_subscription(
            Subscription(name=SUBSCRIPTION, topic=TOPIC, expiration_policy=ttl(1))
        )
        await sleep_until(DAY + 10)
        assert exists(core)
        await sleep_until(1.5 * DAY + 10)
        assert not exists(core)

    run_virtual(scenario())


class _SlowActivityStore(MemoryStore):
    """A store whose activity records are written only once ``written`` is set (a slow disk)."""

    def __init__(self) -> None:
        super().__init__()
        self.written = asyncio.Event()

    async def put_activity(self, activity: Any) -> None:
        await self.written.wait()
        await super().put_activity(activity)


@pytest.mark.parametrize("call", ["pull", "acknowledge", "seek"])
def test_activity_is_recorded_before_the_answer_that_depends_on_it(call: str) -> None:
    """A server killed just after answering a Pull near the ttl must not come back with an older record
    (and expire the subscription early): the call answers only once its activity is written."""

    async def scenario() -> None:
        store = _SlowActivityStore()
        core = PubSubCore(store)
        core.load()
        await core.catalog.create_topic(Topic(name=TOPIC))
        await core.catalog.create_subscription(
            Subscription(name=SUBSCRIPTION, topic=TOPIC, expiration_policy=ttl(1))
        )
        store.written.set()
        await core.publishing.publish(TOPIC, [PubsubMessage(data=b"x")], 10)
        [received] = await core.consumers.pull(SUBSCRIPTION, 1, 0)
        await asyncio.sleep(3600)  # the last record is an hour old: the next activity is recorded
        store.written.clear()
        if call == "pull":
            answer = asyncio.ensure_future(core.consumers.pull(SUBSCRIPTION, 1, 0))
        elif call == "acknowledge":
            answer = asyncio.ensure_future(core.consumers.acknowledge(SUBSCRIPTION, [received.ack_id]))
        else:
            answer = asyncio.ensure_future(core.replay.seek(SUBSCRIPTION, 0, None))
        await asyncio.sleep(1)
        assert not answer.done(), "answered before its activity was recorded"
        store.written.set()
        await answer
        assert store.load().activity[SUBSCRIPTION] >= core.wall_clock_ns() - 2 * 10**9
        await core.close()

    run_virtual(scenario())
