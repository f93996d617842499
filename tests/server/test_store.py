"""The storage contract: the in-memory and the SQLite store pass the same tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from google.iam.v1 import policy_pb2
from google.pubsub_v1.types import pubsub as types

from hedgepub.server import MemoryStore, Store
from hedgepub.server._sqlite import SqliteStore

Topic: Any = types.Topic.pb()
Subscription: Any = types.Subscription.pb()
PubsubMessage: Any = types.PubsubMessage.pb()
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


def message(sequence: int, data: bytes, **attributes: str) -> tuple[int, Any]:
    return sequence, PubsubMessage(data=data, message_id=str(sequence), attributes=attributes)


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
    for name in SUBSCRIPTIONS:
        await store.put("subscriptions", name, Subscription(name=name, topic=TOPIC))
    await store.append(TOPIC, [message(1, b"one", k="v"), message(2, b"two")], SUBSCRIPTIONS)
    await store.append(TOPIC, [message(3, b"three")], SUBSCRIPTIONS[:1])
    await store.ack(SUBSCRIPTIONS[0], [2, 99])
    snapshot = (await reopen()).load()
    first = snapshot.pending[SUBSCRIPTIONS[0]]
    assert [(sequence, m.data) for sequence, m in first] == [(1, b"one"), (3, b"three")]
    assert first[0][1].attributes["k"] == "v"
    assert [sequence for sequence, _ in snapshot.pending[SUBSCRIPTIONS[1]]] == [1, 2]
    assert snapshot.next_sequence == 4


async def test_messages_keep_publish_order_per_topic(stores: tuple[Store, Reopen]) -> None:
    store, _ = stores
    await store.append(TOPIC, [message(1, b"a"), message(2, b"b")], [])
    await store.append("projects/p/topics/other", [message(3, b"c")], [])
    await store.append(TOPIC, [message(4, b"d")], [])
    assert [m.data for _, m in store.messages(TOPIC)] == [b"a", b"b", b"d"]
    assert store.messages("projects/p/topics/none") == []


async def test_deleting_a_subscription_forgets_its_backlog(stores: tuple[Store, Reopen]) -> None:
    store, reopen = stores
    await store.put("subscriptions", SUBSCRIPTIONS[0], Subscription(name=SUBSCRIPTIONS[0], topic=TOPIC))
    await store.append(TOPIC, [message(1, b"x")], SUBSCRIPTIONS[:1])
    await store.delete("subscriptions", SUBSCRIPTIONS[0])
    await store.put("subscriptions", SUBSCRIPTIONS[0], Subscription(name=SUBSCRIPTIONS[0], topic=TOPIC))
    assert (await reopen()).load().pending.get(SUBSCRIPTIONS[0], []) == []


async def test_clear_forgets_everything_but_never_reuses_sequences(stores: tuple[Store, Reopen]) -> None:
    store, reopen = stores
    await store.put("topics", TOPIC, Topic(name=TOPIC))
    await store.append(TOPIC, [message(1, b"x"), message(2, b"y")], [])
    await store.clear()
    snapshot = (await reopen()).load()
    assert snapshot.topics == {} and snapshot.pending == {}
    assert snapshot.next_sequence == 3


async def test_concurrent_writes_all_commit(stores: tuple[Store, Reopen]) -> None:
    store, reopen = stores
    await store.put("subscriptions", SUBSCRIPTIONS[0], Subscription(name=SUBSCRIPTIONS[0], topic=TOPIC))
    await asyncio.gather(*(store.append(TOPIC, [message(i, b"m")], SUBSCRIPTIONS[:1]) for i in range(1, 201)))
    snapshot = (await reopen()).load()
    assert [sequence for sequence, _ in snapshot.pending[SUBSCRIPTIONS[0]]] == list(range(1, 201))


async def test_sqlite_groups_concurrent_writes_into_few_commits(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "group.sqlite3")
    try:
        await asyncio.gather(*(store.append(TOPIC, [message(i, b"m")], []) for i in range(1, 301)))
        assert store.commits < 300
    finally:
        await store.close()


async def test_sqlite_failed_write_fails_only_its_caller(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "fail.sqlite3")
    try:
        await store.append(TOPIC, [message(1, b"m")], [])
        results = await asyncio.gather(
            store.append(TOPIC, [message(1, b"duplicate sequence")], []),
            store.append(TOPIC, [message(2, b"fine")], []),
            return_exceptions=True,
        )
        assert isinstance(results[0], Exception) and results[1] is None
        assert [m.data for _, m in store.messages(TOPIC)] == [b"m", b"fine"]
    finally:
        await store.close()
