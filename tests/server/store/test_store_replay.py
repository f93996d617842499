"""The store operations replay needs (holders of references, snapshots as resources, the sequence at a
time): the in-memory and the SQLite store pass the same tests, SQLite also after a reopen."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from hedgepub.server import MemoryStore, Store
from hedgepub.server._store.sqlite import SqliteStore

from ..._pb import PubsubMessage, Snapshot, Subscription
from .batches import append

TOPIC = "projects/p/topics/stored"
SUBSCRIPTION = "projects/p/subscriptions/first"
SNAPSHOT = "projects/p/snapshots/first-snap"
HOLDER = f"{SUBSCRIPTION}#acked"

Reopen = Callable[[], Awaitable[Store]]


@pytest.fixture(params=["memory", "sqlite"])
async def stores(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[tuple[Store, Reopen]]:
    """A store, and the same store as after a restart (the same object in memory, SQLite reopened)."""
    opened: list[Any] = [MemoryStore() if request.param == "memory" else SqliteStore(tmp_path / "s.sqlite3")]

    async def reopen() -> Store:
        if request.param == "memory":
            return opened[0]
        await opened[-1].close()
        opened.append(SqliteStore(tmp_path / "s.sqlite3"))
        return opened[-1]

    yield opened[0], reopen
    await opened[-1].close()


def message(data: bytes, second: int) -> Any:
    published = PubsubMessage(data=data)
    published.publish_time.seconds = second
    return published


async def fill(store: Store) -> None:
    """Messages 1..5 published at seconds 10, 20, 20, 30, 40, referenced by the subscription."""
    await store.put("subscriptions", SUBSCRIPTION, Subscription(name=SUBSCRIPTION, topic=TOPIC))
    records = [(1, message(b"a", 10)), (2, message(b"b", 20)), (3, message(b"c", 20))]
    records += [(4, message(b"d", 30)), (5, message(b"e", 40))]
    await append(store, TOPIC, records, [SUBSCRIPTION])


async def test_a_holder_keeps_messages_its_subscription_acknowledged(stores: tuple[Store, Reopen]) -> None:
    store, reopen = stores
    await fill(store)
    await store.register(HOLDER)
    await store.reference(HOLDER, [1, 2, 99])  # 99 was never stored: skipped
    await store.ack(SUBSCRIPTION, [1, 2, 3])
    assert [sequence for sequence, _ in store.messages(TOPIC)] == [1, 2, 4, 5]
    store = await reopen()
    assert store.referenced(HOLDER) == [1, 2]
    assert store.referenced(SUBSCRIPTION, 4) == [4, 5]
    assert store.referenced(SUBSCRIPTION, 0, 5) == [4]
    # Referencing older sequences again keeps them in order for paging.
    await store.reference(SUBSCRIPTION, [2, 1])
    assert [sequence for sequence, _ in store.pending(SUBSCRIPTION, 0, 10)] == [1, 2, 4, 5]
    await store.release(HOLDER)
    await store.ack(SUBSCRIPTION, [1, 2])
    assert [sequence for sequence, _ in store.messages(TOPIC)] == [4, 5]
    store = await reopen()
    assert store.referenced(HOLDER) == []


async def test_a_snapshot_is_a_resource_that_holds_references(stores: tuple[Store, Reopen]) -> None:
    store, reopen = stores
    await fill(store)
    await store.put("snapshots", SNAPSHOT, Snapshot(name=SNAPSHOT, topic=TOPIC))
    await store.reference(SNAPSHOT, store.referenced(SUBSCRIPTION))
    await append(store, TOPIC, [(6, message(b"f", 50))], [SUBSCRIPTION, SNAPSHOT])
    await store.ack(SUBSCRIPTION, [1, 2, 3, 4, 5, 6])
    store = await reopen()
    assert store.load().snapshots[SNAPSHOT].topic == TOPIC
    assert store.referenced(SNAPSHOT) == [1, 2, 3, 4, 5, 6]
    assert [m.data for _, m in store.messages(TOPIC)] == [b"a", b"b", b"c", b"d", b"e", b"f"]
    await store.delete("snapshots", SNAPSHOT)
    assert store.messages(TOPIC) == []
    store = await reopen()
    assert store.load().snapshots == {}


@pytest.mark.parametrize(
    ("second", "expected"), [(0, 1), (10, 1), (11, 2), (20, 2), (21, 4), (30, 4), (40, 5), (41, None)]
)
async def test_the_first_sequence_at_a_time(stores: tuple[Store, Reopen], second: int, expected: int) -> None:
    store, _ = stores
    assert store.first_sequence_at(0) is None
    await fill(store)
    assert store.first_sequence_at(second * 1_000_000_000) == expected
    await store.ack(SUBSCRIPTION, [1, 4])  # gaps in the sequence do not matter
    after_gaps = {1: 2, 4: 5}.get(expected, expected) if expected is not None else None
    assert store.first_sequence_at(second * 1_000_000_000) == after_gaps


async def test_exactly_once_leases_are_recorded_and_go_with_their_subscription(
    stores: tuple[Store, Reopen],
) -> None:
    store, reopen = stores
    await fill(store)
    await store.put_leases(SUBSCRIPTION, [(1, "abcdef01-1", 100), (2, "abcdef01-2", 200)])
    await store.put_leases(SUBSCRIPTION, [(2, "abcdef01-3", 300)])  # a later lease of the same message
    await store.drop_leases(SUBSCRIPTION, [1, 7])
    store = await reopen()
    assert store.leases(SUBSCRIPTION) == [(2, "abcdef01-3", 300)]
    await store.delete("subscriptions", SUBSCRIPTION)
    store = await reopen()
    assert store.leases(SUBSCRIPTION) == []
