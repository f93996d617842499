"""Retry-policy back-off: the formula, and redelivery times on virtual time (nack and lease expiry)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from google.pubsub_v1.types import pubsub as types
from hypothesis import given
from hypothesis import strategies as st

from hedgepub.server import MemoryStore, PubSubCore
from hedgepub.server._pubsub.leases import retry_delay
from hedgepub.testing.virtual_time import run_virtual

from ..._pb import PubsubMessage, RetryPolicy, Subscription, Topic
from ..conftest import duration

TOPIC = "projects/p/topics/events"
SUBSCRIPTION = "projects/p/subscriptions/events-sub"
DEAD_LETTERS = "projects/p/topics/dead-letters"


def policy(minimum: float, maximum: float) -> Any:
    return RetryPolicy(minimum_backoff=duration(minimum), maximum_backoff=duration(maximum))


@pytest.mark.parametrize(
    ("attempts", "expected"),
    [(1, 10.0), (2, 20.0), (3, 40.0), (4, 80.0), (5, 100.0), (50, 100.0), (10_000, 100.0)],
)
def test_the_formula_doubles_from_the_minimum_up_to_the_maximum(attempts: int, expected: float) -> None:
    assert retry_delay(policy(10, 100), attempts) == expected


def test_no_policy_means_no_wait() -> None:
    assert retry_delay(None, 1) == 0.0
    assert retry_delay(None, 7) == 0.0


@given(
    minimum=st.floats(0, 600),
    extra=st.floats(0, 600),
    attempts=st.integers(1, 10_000),
)
def test_the_delay_stays_within_the_policy_and_never_shrinks(
    minimum: float, extra: float, attempts: int
) -> None:
    maximum = min(600.0, minimum + extra)
    chosen = policy(minimum, maximum)
    low, high = chosen.minimum_backoff, chosen.maximum_backoff
    low_s, high_s = low.seconds + low.nanos / 1e9, high.seconds + high.nanos / 1e9
    delay = retry_delay(chosen, attempts)
    assert min(low_s, high_s) <= delay <= high_s
    assert retry_delay(chosen, attempts + 1) >= delay


async def make_core(**subscription: Any) -> PubSubCore:
    core = PubSubCore(MemoryStore())
    core.load()
    await core.catalog.create_topic(Topic(name=TOPIC))
    await core.catalog.create_topic(Topic(name=DEAD_LETTERS))
    await core.catalog.create_subscription(Subscription(name=SUBSCRIPTION, topic=TOPIC, **subscription))
    return core


async def publish(core: PubSubCore, *data: bytes, key: str = "") -> None:
    messages = [PubsubMessage(data=item, ordering_key=key) for item in data]
    await core.publishing.publish(TOPIC, messages, sum(m.ByteSize() for m in messages))


def now() -> float:
    return asyncio.get_running_loop().time()


async def next_delivery(core: PubSubCore) -> tuple[float, Any]:
    consumer = core.consumers.open_consumer(SUBSCRIPTION, 10.0)
    (received,) = await core.consumers.next_batch(SUBSCRIPTION, consumer)
    core.consumers.close_consumer(SUBSCRIPTION, consumer)
    return now(), received


def test_nacked_messages_come_back_after_the_back_off() -> None:
    async def scenario() -> None:
        core = await make_core(retry_policy=policy(5, 12))
        await publish(core, b"one")
        times = []
        for _ in range(5):
            at, received = await next_delivery(core)
            times.append(round(at, 3))
            core.consumers.modify_ack_deadline(SUBSCRIPTION, [received.ack_id], 0)
        # Deliveries at 0, then after 5, 10, 12 (capped) and 12 s.
        assert times == [0.0, 5.0, 15.0, 27.0, 39.0]

    run_virtual(scenario())


def test_an_expired_lease_backs_off_too() -> None:
    async def scenario() -> None:
        core = await make_core(retry_policy=policy(30, 600), ack_deadline_seconds=10)
        await publish(core, b"one")
        await core.consumers.pull(SUBSCRIPTION, 1, 0)
        at, received = await next_delivery(core)
        # The lease ran out at 10 s; the message waited 30 s more.
        assert 40.0 <= at < 40.1
        assert received.message.data == b"one"

    run_virtual(scenario())


def test_without_a_retry_policy_a_nack_redelivers_at_once() -> None:
    async def scenario() -> None:
        core = await make_core()
        await publish(core, b"one")
        (received,) = await core.consumers.pull(SUBSCRIPTION, 1, 0)
        core.consumers.modify_ack_deadline(SUBSCRIPTION, [received.ack_id], 0)
        assert [r.message.data for r in await core.consumers.pull(SUBSCRIPTION, 1, 0)] == [b"one"]

    run_virtual(scenario())


def test_other_messages_are_delivered_while_one_backs_off() -> None:
    async def scenario() -> None:
        core = await make_core(retry_policy=policy(60, 600))
        await publish(core, b"one", b"two")
        (first,) = await core.consumers.pull(SUBSCRIPTION, 1, 0)
        core.consumers.modify_ack_deadline(SUBSCRIPTION, [first.ack_id], 0)
        (second,) = await core.consumers.pull(SUBSCRIPTION, 1, 0)
        assert second.message.data == b"two"
        assert not core.is_idle()  # the backing-off message still counts
        await core.consumers.acknowledge(SUBSCRIPTION, [second.ack_id])
        at, again = await next_delivery(core)
        assert (round(at), again.message.data) == (60, b"one")

    run_virtual(scenario())


def test_an_ordering_key_waits_for_its_backing_off_head() -> None:
    async def scenario() -> None:
        core = await make_core(retry_policy=policy(20, 600), enable_message_ordering=True)
        await publish(core, b"k1", b"k2", key="k")
        first, second = await core.consumers.pull(SUBSCRIPTION, 10, 0)
        assert (first.message.data, second.message.data) == (b"k1", b"k2")
        # The nack of k1 takes k2 back with it: the key delivers nothing until k1's back-off ends, then
        # k1 and k2 again, in order.
        core.consumers.modify_ack_deadline(SUBSCRIPTION, [first.ack_id], 0)
        assert await core.consumers.pull(SUBSCRIPTION, 10, 0) == []
        consumer = core.consumers.open_consumer(SUBSCRIPTION, 10.0)
        again = await core.consumers.next_batch(SUBSCRIPTION, consumer)
        assert (round(now()), [r.message.data for r in again]) == (20, [b"k1", b"k2"])
        assert [r.delivery_attempt for r in again] == [0, 0]  # no dead-letter policy: not counted

    run_virtual(scenario())


def test_dead_lettering_is_not_delayed_by_the_back_off() -> None:
    async def scenario() -> None:
        dead_letter = types.DeadLetterPolicy.pb()(dead_letter_topic=DEAD_LETTERS, max_delivery_attempts=5)
        core = await make_core(retry_policy=policy(1, 1), dead_letter_policy=dead_letter)
        await core.catalog.create_subscription(
            Subscription(name="projects/p/subscriptions/dead", topic=DEAD_LETTERS)
        )
        await publish(core, b"one")
        for _ in range(5):
            _, received = await next_delivery(core)
            core.consumers.modify_ack_deadline(SUBSCRIPTION, [received.ack_id], 0)
        forwarded = await core.consumers.pull("projects/p/subscriptions/dead", 1, 5.0)
        assert [r.message.data for r in forwarded] == [b"one"]
        # Four back-offs of 1 s between the five deliveries; the fifth nack forwards at once.
        assert round(now(), 3) == 4.0

    run_virtual(scenario())


def test_deleting_a_subscription_drops_its_backing_off_messages() -> None:
    async def scenario() -> None:
        core = await make_core(retry_policy=policy(60, 600))
        await publish(core, b"one")
        (received,) = await core.consumers.pull(SUBSCRIPTION, 1, 0)
        core.consumers.modify_ack_deadline(SUBSCRIPTION, [received.ack_id], 0)
        await core.catalog.delete_subscription(SUBSCRIPTION)
        assert core.is_idle()
        await asyncio.sleep(120)  # the cancelled timer must not resurrect anything
        assert core.is_idle()

    run_virtual(scenario())
