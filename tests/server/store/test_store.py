"""The storage contract: the in-memory and the SQLite store pass the same tests."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from google.iam.v1 import policy_pb2

from hedgepub.server import MemoryStore, Store
from hedgepub.server._store.sqlite import SqliteStore

from ..._pb import PubsubMessage, Subscription, Topic
from .batches import append

TOPIC = "projects/p/topics/stored"
SUBSCRIPTIONS = ["projects/p/subscriptions/first", "projects/p/subscriptions/second"]

Reopen = Callable[[], Awaitable[Store]]


@pytest.fixture(params=["memory", "sqlite"])
async def stores(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[tuple[Store, Reopen]]:
    """A store, and a way to get it back as after a restart (same object in memory, reopened SQLite)."""
    opened: list[Store] = []
    if request.param == "memory":
        memory = MemoryStore()
        opened.append(memory)

        async def reopen() -> Store:
            return memory

    else:

        async def reopen() -> Store:
            await opened[-1].close()
            opened.append(SqliteStore(tmp_path / "store.sqlite3"))
            return opened[-1]

        opened.append(SqliteStore(tmp_path / "store.sqlite3"))
    yield opened[0], reopen
    await opened[-1].close()


@pytest.fixture(params=["memory", "sqlite"])
async def keeping(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    """A store that keeps messages published while their topic has no subscription."""
    store: Store
    if request.param == "memory":
        store = MemoryStore(keep_unsubscribed=True)
    else:
        store = SqliteStore(tmp_path / "keeping.sqlite3", keep_unsubscribed=True)
    yield store
    await store.close()


def message(sequence: int, data: bytes, **attributes: str) -> tuple[int, Any]:
    return sequence, PubsubMessage(data=data, message_id=str(sequence), attributes=attributes)


def backlog(store: Store, subscription: str) -> list[int]:
    return [sequence for sequence, _ in store.pending(subscription, 0, 10_000)]


async def subscribe(store: Store, *names: str) -> None:
    for name in names:
        await store.put("subscriptions", name, Subscription(name=name, topic=TOPIC))


async def test_resources_round_trip(stores: tuple[Store, Reopen]) -> None:
    store, reopen = stores
    await store.put("topics", TOPIC, Topic(name=TOPIC, labels={"a": "b"}))
    await store.put("subscriptions", SUBSCRIPTIONS[0], Subscription(name=SUBSCRIPTIONS[0], topic=TOPIC))
    await store.put("policies", TOPIC, policy_pb2.Policy(etag=b"e1"))
    await store.put("topics", TOPIC, Topic(name=TOPIC, labels={"a": "c"}))  # replace
    snapshot = (await reopen()).load()
    assert snapshot.topics[TOPIC].labels["a"] == "c"
    assert snapshot.subscriptions[SUBSCRIPTIONS[0]].topic == TOPIC
    assert snapshot.policies[TOPIC].etag == b"e1"
    store = await reopen()
    await store.delete("topics", TOPIC)
    assert TOPIC not in (await reopen()).load().topics


async def test_unacked_messages_come_back_per_subscription(stores: tuple[Store, Reopen]) -> None:
    store, reopen = stores
    await subscribe(store, *SUBSCRIPTIONS)
    await append(store, TOPIC, [message(1, b"one", k="v"), message(2, b"two")], SUBSCRIPTIONS)
    await append(store, TOPIC, [message(3, b"three")], SUBSCRIPTIONS[:1])
    await store.ack(SUBSCRIPTIONS[0], [2, 99])
    await store.ack(SUBSCRIPTIONS[1], [3])  # never its message: changes nothing
    store = await reopen()
    first = store.pending(SUBSCRIPTIONS[0], 0, 10)
    assert [(sequence, m.data) for sequence, m in first] == [(1, b"one"), (3, b"three")]
    assert first[0][1].attributes["k"] == "v"
    assert backlog(store, SUBSCRIPTIONS[1]) == [1, 2]
    assert store.load().next_sequence == 4


async def test_pending_reads_a_backlog_in_pages(stores: tuple[Store, Reopen]) -> None:
    store, reopen = stores
    await subscribe(store, SUBSCRIPTIONS[0])
    await append(store, TOPIC, [message(i, b"m") for i in range(1, 11)], SUBSCRIPTIONS[:1])
    await store.ack(SUBSCRIPTIONS[0], [4, 5])
    store = await reopen()
    assert [s for s, _ in store.pending(SUBSCRIPTIONS[0], 0, 3)] == [1, 2, 3]
    assert [s for s, _ in store.pending(SUBSCRIPTIONS[0], 3, 3)] == [6, 7, 8]
    assert [s for s, _ in store.pending(SUBSCRIPTIONS[0], 8, 3)] == [9, 10]
    assert store.pending(SUBSCRIPTIONS[0], 10, 3) == []
    assert store.pending("projects/p/subscriptions/unknown", 0, 3) == []


async def test_a_message_is_stored_once_and_goes_with_its_last_reference(
    stores: tuple[Store, Reopen],
) -> None:
    store, reopen = stores
    await subscribe(store, *SUBSCRIPTIONS)
    await append(store, TOPIC, [message(1, b"a"), message(2, b"b")], SUBSCRIPTIONS)
    assert [m.data for _, m in store.messages(TOPIC)] == [b"a", b"b"]  # once, not once per subscription
    await store.ack(SUBSCRIPTIONS[0], [1, 2])
    assert [m.data for _, m in store.messages(TOPIC)] == [b"a", b"b"]  # the second still needs them
    await store.ack(SUBSCRIPTIONS[1], [1])
    store = await reopen()
    assert [m.data for _, m in store.messages(TOPIC)] == [b"b"]
    await store.ack(SUBSCRIPTIONS[1], [2])
    store = await reopen()
    assert store.messages(TOPIC) == []
    # The highest message went too, yet its sequence is never handed out again.
    assert store.load().next_sequence == 3


async def test_unsubscribed_messages_are_dropped_unless_kept(
    stores: tuple[Store, Reopen], keeping: Store
) -> None:
    store, reopen = stores
    await append(store, TOPIC, [message(1, b"a"), message(2, b"b")], [])
    store = await reopen()
    assert store.messages(TOPIC) == []
    assert store.load().next_sequence == 3
    await append(keeping, TOPIC, [message(1, b"a"), message(2, b"b")], [])
    await append(keeping, "projects/p/topics/other", [message(3, b"c")], [])
    await append(keeping, TOPIC, [message(4, b"d")], [])
    assert [m.data for _, m in keeping.messages(TOPIC)] == [b"a", b"b", b"d"]
    assert keeping.messages("projects/p/topics/none") == []


async def test_deleting_a_subscription_forgets_its_backlog(stores: tuple[Store, Reopen]) -> None:
    store, reopen = stores
    await subscribe(store, *SUBSCRIPTIONS)
    await append(store, TOPIC, [message(1, b"x")], SUBSCRIPTIONS[:1])
    await append(store, TOPIC, [message(2, b"y")], SUBSCRIPTIONS)
    await store.delete("subscriptions", SUBSCRIPTIONS[0])
    await subscribe(store, SUBSCRIPTIONS[0])
    store = await reopen()
    assert backlog(store, SUBSCRIPTIONS[0]) == []
    assert backlog(store, SUBSCRIPTIONS[1]) == [2]
    assert [m.data for _, m in store.messages(TOPIC)] == [b"y"]  # x was only its


async def test_clear_forgets_everything_but_never_reuses_sequences(stores: tuple[Store, Reopen]) -> None:
    store, reopen = stores
    await store.put("topics", TOPIC, Topic(name=TOPIC))
    await subscribe(store, SUBSCRIPTIONS[0])
    await append(store, TOPIC, [message(1, b"x"), message(2, b"y")], SUBSCRIPTIONS[:1])
    await store.clear()
    store = await reopen()
    snapshot = store.load()
    assert snapshot.topics == {} and snapshot.subscriptions == {}
    assert store.messages(TOPIC) == [] and backlog(store, SUBSCRIPTIONS[0]) == []
    assert snapshot.next_sequence == 3


async def test_delivery_attempts_are_kept_on_references(stores: tuple[Store, Reopen]) -> None:
    store, reopen = stores
    await subscribe(store, *SUBSCRIPTIONS)
    await append(store, TOPIC, [message(i, b"m") for i in range(1, 6)], SUBSCRIPTIONS)
    await store.record_attempts(SUBSCRIPTIONS[0], [(2, 1), (4, 3), (99, 7)])  # 99: never referenced
    await store.record_attempts(SUBSCRIPTIONS[0], [(2, 2)])  # a later count replaces the earlier one
    store = await reopen()
    assert store.attempts(SUBSCRIPTIONS[0], 0, 5) == {2: 2, 4: 3}
    assert store.attempts(SUBSCRIPTIONS[0], 2, 3) == {}  # (after, through]
    assert store.attempts(SUBSCRIPTIONS[0], 1, 2) == {2: 2}
    assert store.attempts(SUBSCRIPTIONS[1], 0, 5) == {}  # per subscription
    await store.ack(SUBSCRIPTIONS[0], [4])
    await store.record_attempts(SUBSCRIPTIONS[0], [(4, 4)])  # acknowledged meanwhile: skipped
    store = await reopen()
    assert store.attempts(SUBSCRIPTIONS[0], 0, 5) == {2: 2}
    await store.delete("subscriptions", SUBSCRIPTIONS[0])
    await subscribe(store, SUBSCRIPTIONS[0])  # the same name again: a new subscription, nothing counted
    assert store.attempts(SUBSCRIPTIONS[0], 0, 5) == {}


async def test_subscription_activity_is_kept_until_the_subscription_goes(
    stores: tuple[Store, Reopen],
) -> None:
    store, reopen = stores
    await subscribe(store, *SUBSCRIPTIONS)
    unknown = "projects/p/subscriptions/unknown"
    await store.put_activity([(SUBSCRIPTIONS[0], 10), (SUBSCRIPTIONS[1], 20), (unknown, 30)])
    await store.put_activity([(SUBSCRIPTIONS[0], 40)])  # replaces
    store = await reopen()
    assert store.load().activity == {SUBSCRIPTIONS[0]: 40, SUBSCRIPTIONS[1]: 20}
    await store.delete("subscriptions", SUBSCRIPTIONS[1])
    store = await reopen()
    assert store.load().activity == {SUBSCRIPTIONS[0]: 40}
    await store.clear()
    assert (await reopen()).load().activity == {}


async def test_concurrent_writes_all_commit(stores: tuple[Store, Reopen]) -> None:
    store, reopen = stores
    await subscribe(store, SUBSCRIPTIONS[0])
    await asyncio.gather(
        *(append(store, TOPIC, [message(i, b"m")], SUBSCRIPTIONS[:1]) for i in range(1, 201))
    )
    store = await reopen()
    assert backlog(store, SUBSCRIPTIONS[0]) == list(range(1, 201))


async def test_sqlite_groups_concurrent_writes_into_few_commits(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "group.sqlite3")
    try:
        await subscribe(store, SUBSCRIPTIONS[0])
        await asyncio.gather(
            *(append(store, TOPIC, [message(i, b"m")], SUBSCRIPTIONS[:1]) for i in range(1, 301))
        )
        assert store.commits < 300
    finally:
        await store.close()


async def test_sqlite_failed_write_fails_only_its_caller(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "fail.sqlite3")
    try:
        await subscribe(store, SUBSCRIPTIONS[0])
        await append(store, TOPIC, [message(1, b"m")], SUBSCRIPTIONS[:1])
        results = await asyncio.gather(
            append(store, TOPIC, [message(1, b"duplicate sequence")], SUBSCRIPTIONS[:1]),
            append(store, TOPIC, [message(2, b"fine")], SUBSCRIPTIONS[:1]),
            return_exceptions=True,
        )
        assert isinstance(results[0], Exception) and results[1] is None
        assert [m.data for _, m in store.messages(TOPIC)] == [b"m", b"fine"]
    finally:
        await store.close()


async def test_sqlite_append_that_fails_leaves_nothing_of_it(tmp_path: Path) -> None:
    """A Publish to one subscription is one statement committed alone: when its last part (the span over
    its messages) fails, its batch and body are not kept either, and the store goes on."""
    path = tmp_path / "atomic.sqlite3"
    store = SqliteStore(path)
    try:
        await subscribe(store, SUBSCRIPTIONS[0])
        await append(store, TOPIC, [message(5, b"five")], SUBSCRIPTIONS[:1])
        # A stray span where the next batch will start, written behind the store's back: the batch at 3
        # and its body are new, its span is not.
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as other:
            other.execute(
                "INSERT INTO spans (subscription, first) SELECT id, 3 FROM subscription_ids WHERE name = ?",
                (SUBSCRIPTIONS[0],),
            )
        with pytest.raises(Exception, match="UNIQUE"):
            await append(store, TOPIC, [message(3, b"three"), message(4, b"four")], SUBSCRIPTIONS[:1])
        await append(store, TOPIC, [message(6, b"six")], SUBSCRIPTIONS[:1])
    finally:
        await store.close()
    store = SqliteStore(path)
    try:
        assert [(sequence, m.data) for sequence, m in store.messages(TOPIC)] == [(5, b"five"), (6, b"six")]
        assert backlog(store, SUBSCRIPTIONS[0]) == [5, 6]
    finally:
        await store.close()
