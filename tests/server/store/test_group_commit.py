"""Group commit on the event loop: a step's writes committed there when the writer thread holds nothing,
in the order they were made when it does, never there when a commit fsyncs, and checkpoints left to the
thread."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Awaitable
from pathlib import Path

import pytest

from hedgepub.server._store import group_commit
from hedgepub.server._store.group_commit import ON_THREAD, GroupCommitWriter
from hedgepub.server._store.sqlite import SqliteStore

from ..._pb import PubsubMessage, Subscription
from .batches import append

SUBSCRIPTION = "projects/p/subscriptions/loop"
TOPIC = "projects/p/topics/loop"


def _connect(path: Path) -> sqlite3.Connection:
    connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("CREATE TABLE IF NOT EXISTS log (n INTEGER PRIMARY KEY AUTOINCREMENT, value TEXT)")
    return connection


def _insert(value: str) -> group_commit.Operation:
    def operation(connection: sqlite3.Connection) -> None:
        connection.execute("INSERT INTO log (value) VALUES (?)", (value,))

    return operation


def _values(path: Path) -> list[str]:
    with sqlite3.connect(path) as connection:
        return [value for (value,) in connection.execute("SELECT value FROM log ORDER BY n")]


async def test_a_steps_writes_commit_together_on_the_loop(tmp_path: Path) -> None:
    writer = GroupCommitWriter(lambda: _connect(tmp_path / "db"), on_loop=True)
    try:
        await asyncio.gather(*(writer.write(_insert(str(index))) for index in range(100)))
        assert writer.commits == 1
        assert writer.loop_commits == 1
        assert _values(tmp_path / "db") == [str(index) for index in range(100)]
    finally:
        await writer.close()


async def _after_steps(steps: int, write: Awaitable[None]) -> None:
    """``write``, awaited after ``steps`` turns of the loop (so it is made in a later step)."""
    for _ in range(steps):
        await asyncio.sleep(0)
    await write


async def test_writes_of_the_steps_that_follow_join_a_commit_waiting_for_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While other callbacks are ready, a step's commit waits for them: writes made in the steps that
    follow fold into it; once nothing else is ready it commits, however long it may still wait."""
    monkeypatch.setattr(group_commit, "_LINGER_SECONDS", 3600.0)
    writer = GroupCommitWriter(lambda: _connect(tmp_path / "db"), on_loop=True)
    try:
        await asyncio.gather(*(_after_steps(steps, writer.write(_insert(str(steps)))) for steps in range(6)))
        assert writer.commits == 1
        assert writer.loop_commits == 1
        assert _values(tmp_path / "db") == [str(steps) for steps in range(6)]
    finally:
        await writer.close()


async def test_a_commit_waits_for_a_loop_that_stays_busy_only_so_long(tmp_path: Path) -> None:
    """A loop that always has another callback ready (here one that schedules itself again) does not
    keep a write from committing: the commit waits at most _LINGER_SECONDS."""
    writer = GroupCommitWriter(lambda: _connect(tmp_path / "db"), on_loop=True)
    loop = asyncio.get_running_loop()
    spinning = True
    spins = 0

    def spin() -> None:
        nonlocal spins
        spins += 1
        if spinning:
            loop.call_soon(spin)

    loop.call_soon(spin)
    try:
        await writer.write(_insert("while busy"))
        assert spins > 1  # the loop was busy all along
        assert _values(tmp_path / "db") == ["while busy"]
    finally:
        spinning = False
        await writer.close()


async def test_writes_keep_their_order_while_the_thread_is_busy(tmp_path: Path) -> None:
    """A write made while an earlier one waits for the thread goes to the thread too, after it."""
    writer = GroupCommitWriter(lambda: _connect(tmp_path / "db"), on_loop=True)
    release = threading.Event()

    def slow(connection: sqlite3.Connection) -> None:
        release.wait(30)
        connection.execute("INSERT INTO log (value) VALUES ('slow')")

    try:
        await writer.write(_insert("first"))
        slow_write = asyncio.ensure_future(writer.write(slow, ON_THREAD))
        while writer._outstanding == 0:  # until the slow write is handed to the thread
            await asyncio.sleep(0)
        later = asyncio.ensure_future(writer.write(_insert("later")))
        await asyncio.sleep(0)
        release.set()
        await asyncio.gather(slow_write, later)
        assert _values(tmp_path / "db") == ["first", "slow", "later"]
        assert writer.loop_commits == 1
    finally:
        release.set()
        await writer.close()


async def test_a_failed_write_on_the_loop_fails_only_its_caller(tmp_path: Path) -> None:
    writer = GroupCommitWriter(lambda: _connect(tmp_path / "db"), on_loop=True)

    def broken(connection: sqlite3.Connection) -> None:
        connection.execute("INSERT INTO missing VALUES (1)")

    try:
        results = await asyncio.gather(
            writer.write(_insert("a")),
            writer.write(broken),
            writer.write(_insert("b")),
            return_exceptions=True,
        )
        assert results[0] is None and results[2] is None
        assert isinstance(results[1], sqlite3.OperationalError)
        assert _values(tmp_path / "db") == ["a", "b"]
    finally:
        await writer.close()


async def test_checkpoints_run_on_the_writer_thread(tmp_path: Path) -> None:
    """With commits on the loop SQLite's own checkpoint is off; the thread checkpoints after a number
    of them, so the WAL's frames get copied into the database."""
    threads: set[str] = set()

    def connect() -> sqlite3.Connection:
        connection = _connect(tmp_path / "db")
        connection.set_trace_callback(
            lambda sql: threads.add(threading.current_thread().name) if "wal_checkpoint" in sql else None
        )
        return connection

    writer = GroupCommitWriter(connect, on_loop=True)
    try:
        for index in range(group_commit._CHECKPOINT_COMMITS):
            await writer.write(_insert(str(index)))
        # The last commit handed a checkpoint to the thread: until the thread is done with it, nothing
        # commits on the loop.
        assert writer._outstanding == 1
        for _ in range(3000):
            if writer._outstanding == 0:
                break
            await asyncio.sleep(0.01)
        assert threads == {"hedgepub-sqlite"}
    finally:
        await writer.close()


async def test_sqlite_store_commits_on_the_loop_unless_each_commit_syncs(tmp_path: Path) -> None:
    for synchronous, on_loop in (("NORMAL", True), ("FULL", False)):
        store = SqliteStore(tmp_path / f"{synchronous}.sqlite3", synchronous=synchronous)
        try:
            await store.put("subscriptions", SUBSCRIPTION, Subscription(name=SUBSCRIPTION, topic=TOPIC))
            await append(store, TOPIC, [(1, PubsubMessage(data=b"m"))], [SUBSCRIPTION])
            assert (store._writer.loop_commits > 0) is on_loop
        finally:
            await store.close()


async def test_a_file_that_cannot_be_opened_fails_the_write(tmp_path: Path) -> None:
    """An error outside any one write (here: opening the file) fails the step's writes, not hangs them."""

    def connect() -> sqlite3.Connection:
        raise sqlite3.OperationalError("unable to open database file")

    writer = GroupCommitWriter(connect, on_loop=True)
    results = await asyncio.gather(
        writer.write(_insert("a")), writer.write(_insert("b")), return_exceptions=True
    )
    assert all(isinstance(result, sqlite3.OperationalError) for result in results)
