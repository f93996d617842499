"""Per-subscription state that outlives a restart: delivery attempts under a dead-letter policy, and the
expiration inactivity clock.

The attempts test kills ``hedgepub serve`` with SIGKILL (nothing is flushed or closed) between nacks, and
checks that the count goes on where it was: seen through raw gRPC before the kill and through the
official client's ``message.delivery_attempt`` after it. The expiration tests restart the core on the same
SQLite file (or in-memory store) under a clock the test moves, with the calendar time following it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import os
import signal
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from google.cloud import pubsub_v1

from hedgepub.server import MemoryStore, PubSubCore, ServiceError, Store
from hedgepub.server._store.sqlite import SqliteStore

from ..._pb import ModifyAckDeadlineRequest, PublishRequest, PubsubMessage, PullRequest, Subscription, Topic
from ..conftest import RawClient

PROJECT = "projects/restarts"
TOPIC = f"{PROJECT}/topics/work"
SUBSCRIPTION = f"{PROJECT}/subscriptions/work-sub"
DEAD_LETTERS = f"{PROJECT}/topics/dead-letters"
DEAD_LETTER_SUBSCRIPTION = f"{PROJECT}/subscriptions/dead-letters-sub"


def server_address() -> str:
    """Where ``hedgepub_serve`` put the server (it sets PUBSUB_EMULATOR_HOST)."""
    return os.environ["PUBSUB_EMULATOR_HOST"]


def _pull_one(raw: RawClient, subscription: str) -> Any:
    (received,) = raw.call(
        "Pull", PullRequest(subscription=subscription, max_messages=1), timeout=20
    ).received_messages
    return received


def test_delivery_attempts_go_on_after_a_sigkill(hedgepub_serve: Any) -> None:
    server = hedgepub_serve()
    raw = RawClient(server_address())
    try:
        raw.call("CreateTopic", Topic(name=TOPIC))
        raw.call("CreateTopic", Topic(name=DEAD_LETTERS))
        raw.call("CreateSubscription", Subscription(name=DEAD_LETTER_SUBSCRIPTION, topic=DEAD_LETTERS))
        config = Subscription(name=SUBSCRIPTION, topic=TOPIC, ack_deadline_seconds=60)
        config.dead_letter_policy.dead_letter_topic = DEAD_LETTERS
        config.dead_letter_policy.max_delivery_attempts = 5
        raw.call("CreateSubscription", config)
        raw.call("Publish", PublishRequest(topic=TOPIC, messages=[PubsubMessage(data=b"poison")]))
        for attempt in (1, 2, 3):
            received = _pull_one(raw, SUBSCRIPTION)
            assert received.delivery_attempt == attempt
            # Answered once the count is in the store.
            raw.call(
                "ModifyAckDeadline",
                ModifyAckDeadlineRequest(
                    subscription=SUBSCRIPTION, ack_ids=[received.ack_id], ack_deadline_seconds=0
                ),
            )
    finally:
        raw.close()
    server.send_signal(signal.SIGKILL)
    server.wait(10)

    hedgepub_serve()
    # The official client (streaming pull, nacks by ModifyAckDeadline) sees the count go on: 4, then 5,
    # and the fifth nack sends the message to the dead-letter topic.
    subscriber = pubsub_v1.SubscriberClient()
    seen: list[int | None] = []
    both = threading.Event()

    def nack(message: Any) -> None:
        seen.append(message.delivery_attempt)
        message.nack()
        if len(seen) == 2:
            both.set()

    streaming = subscriber.subscribe(SUBSCRIPTION, nack)
    try:
        assert both.wait(30), seen
    finally:
        streaming.cancel()
        streaming.result(timeout=10)
        subscriber.close()
    assert seen == [4, 5]
    raw = RawClient(server_address())
    try:
        forwarded = _pull_one(raw, DEAD_LETTER_SUBSCRIPTION)
        assert forwarded.message.data == b"poison"
        assert forwarded.message.attributes["CloudPubSubDeadLetterSourceDeliveryCount"] == "5"
        empty = raw.call(
            "Pull", PullRequest(subscription=SUBSCRIPTION, max_messages=1, return_immediately=True)
        )
        assert list(empty.received_messages) == []
    finally:
        raw.close()


# ---------------------------------------------------------------- the expiration inactivity clock
DAY = 24 * 3600.0
#: The calendar time at the first server's clock 0 (any fixed moment: the wall clock follows the test's).
EPOCH_NS = 1_800_000_000 * 10**9


class _Timer:
    __slots__ = ("callback", "cancelled")

    def __init__(self, callback: Callable[[], object]) -> None:
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ManualClock:
    """The server's clock, moved only by the test: :meth:`advance` runs the timers that fall due, in order.

    Unlike a virtual-time loop it never jumps while the loop waits for SQLite's writer thread.
    """

    def __init__(self, start: float = 0.0) -> None:
        self.time = start
        self._timers: list[tuple[float, int, _Timer]] = []
        self._serial = itertools.count()

    def now(self) -> float:
        return self.time

    async def sleep(self, seconds: float) -> None:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.call_later(seconds, lambda: done.done() or done.set_result(None))
        await done

    def call_later(self, delay: float, callback: Callable[[], object]) -> _Timer:
        timer = _Timer(callback)
        heapq.heappush(self._timers, (self.time + max(0.0, delay), next(self._serial), timer))
        return timer

    def advance_to(self, moment: float) -> None:
        while self._timers and self._timers[0][0] <= moment:
            when, _, timer = heapq.heappop(self._timers)
            if not timer.cancelled:
                self.time = when
                timer.callback()
        self.time = moment


class Server:
    """A core on a store, with a manual clock whose every reading maps to the calendar time ``wall_at``."""

    def __init__(
        self,
        store: Store,
        clock: ManualClock,
        wall_at: Callable[[float], float],
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        self.clock = clock
        self.core = PubSubCore(store, clock, lambda: EPOCH_NS + round(wall_at(clock.time) * 1e9))
        self.core.load()
        self._caplog = caplog
        caplog.set_level(logging.INFO, logger="hedgepub.server")

    def exists(self, name: str) -> bool:
        try:
            self.core.catalog.get_subscription(name)
        except ServiceError:
            return False
        return True

    async def expires_by(self, moment: float, name: str) -> bool:
        """Advance to ``moment`` (server clock); whether ``name`` expired by then. The decision is logged
        at once, when the timer fires; the deletion it starts runs through the store, and is waited for."""
        self.clock.advance_to(moment)
        if f"Subscription {name} was inactive" not in self._caplog.text:
            return False
        for _ in range(500):
            if not self.exists(name):
                return True
            await asyncio.sleep(0.01)
        raise AssertionError(f"{name} expired but was not deleted")


def _with_ttl(name: str, days: float) -> Any:
    config = Subscription(name=name, topic=TOPIC)
    config.expiration_policy.ttl.seconds = int(days * DAY)
    return config


IDLE = f"{PROJECT}/subscriptions/idle"
PULLED = f"{PROJECT}/subscriptions/pulled"
STREAMED = f"{PROJECT}/subscriptions/streamed"


@pytest.mark.parametrize("kind", ["sqlite", "memory"])
async def test_the_inactivity_clock_goes_on_after_a_restart(
    kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Three subscriptions with a one-day ttl: one idle since its creation, one pulled at half a day, one
    with a stream open until the restart. The server restarts at 0.75 day on a clock that starts
    elsewhere; each expires a day after its last activity, give or take the minute records are apart."""
    memory = MemoryStore()

    def open_store() -> Store:
        return SqliteStore(tmp_path / "expiring.sqlite3") if kind == "sqlite" else memory

    first = Server(open_store(), ManualClock(), lambda time: time, caplog)
    await first.core.catalog.create_topic(Topic(name=TOPIC))
    for name in (IDLE, PULLED, STREAMED):
        await first.core.catalog.create_subscription(_with_ttl(name, 1))
    first.core.consumers.open_consumer(STREAMED, 10.0)  # never closed: the server goes down with it open
    first.clock.advance_to(0.5 * DAY)
    await first.core.consumers.pull(PULLED, 1, 0)
    first.clock.advance_to(0.75 * DAY)
    await first.core.close()

    # The new process's monotonic clock starts at 1000 s; the calendar goes on from 0.75 day.
    second = Server(open_store(), ManualClock(1000.0), lambda time: 0.75 * DAY + time - 1000.0, caplog)

    def at(wall: float) -> float:  # the second server's clock reading at calendar time ``wall``
        return wall - 0.75 * DAY + 1000.0

    assert all(second.exists(name) for name in (IDLE, PULLED, STREAMED))
    # IDLE: created at 0, so gone a day (and at most a minute) later, not a day after the restart.
    assert not await second.expires_by(at(DAY - 1), IDLE)
    assert await second.expires_by(at(DAY + 61), IDLE)
    # PULLED: a day after its pull at half a day.
    assert not await second.expires_by(at(1.5 * DAY - 1), PULLED)
    assert await second.expires_by(at(1.5 * DAY + 61), PULLED)
    # STREAMED: its open stream was recorded every minute up to the restart.
    assert not await second.expires_by(at(1.75 * DAY - 1), STREAMED)
    assert await second.expires_by(at(1.75 * DAY + 61), STREAMED)
    await second.core.close()


async def test_a_data_directory_without_recorded_activity_starts_the_clock_at_load(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "earlier.sqlite3"
    first = Server(SqliteStore(path), ManualClock(), lambda time: time, caplog)
    await first.core.catalog.create_topic(Topic(name=TOPIC))
    await first.core.catalog.create_subscription(_with_ttl(IDLE, 1))
    await first.core.close()
    with sqlite3.connect(path) as earlier:  # as written by a hedgepub without the table
        earlier.execute("DROP TABLE activity")

    second = Server(SqliteStore(path), ManualClock(), lambda time: 0.9 * DAY + time, caplog)
    assert not await second.expires_by(DAY - 1, IDLE)  # 1.9 days after the creation: the load counts
    assert await second.expires_by(DAY + 1, IDLE)
    await second.core.close()
