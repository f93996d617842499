"""The durable :class:`~hedgepub.server._store.Store`: SQLite in WAL mode, written by one thread.

Every write is queued to a dedicated writer thread, which takes *everything* queued at that moment and
commits it in one transaction (group commit): many concurrent Publish calls cost one commit, and the
event loop never waits on the disk. Each caller's future resolves only after the commit that holds its
change, so a Publish is answered only once its messages are on disk; a ``kill -9`` of the server loses
nothing it acknowledged. With ``synchronous=NORMAL`` (the default) a commit survives the process being
killed, not a power cut; ``synchronous="FULL"`` survives both, at the cost of an fsync per commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sqlite3
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from hedgepub.server._store import PubsubMessage, ResourceKind, Snapshot, resource_class

_SCHEMA = """
CREATE TABLE IF NOT EXISTS topics (name TEXT PRIMARY KEY, body BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS subscriptions (name TEXT PRIMARY KEY, body BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS policies (name TEXT PRIMARY KEY, body BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS schemas (name TEXT PRIMARY KEY, body BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS messages (sequence INTEGER PRIMARY KEY, topic TEXT NOT NULL, body BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS messages_by_topic ON messages (topic, sequence);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS pending (
    subscription TEXT NOT NULL,
    sequence INTEGER NOT NULL,
    PRIMARY KEY (subscription, sequence)
) WITHOUT ROWID;
"""
_TABLES = ("topics", "subscriptions", "policies", "schemas")
#: Most operations folded into one transaction, so one commit never grows without bound.
_MAX_GROUP = 512

_Operation = Callable[[sqlite3.Connection], None]


class SqliteStore:
    """A :class:`~hedgepub.server._store.Store` in one SQLite file (WAL), with group commit."""

    def __init__(self, path: str | Path, *, synchronous: str = "NORMAL") -> None:
        if synchronous.upper() not in {"OFF", "NORMAL", "FULL", "EXTRA"}:
            raise ValueError(f"synchronous must be OFF, NORMAL, FULL or EXTRA; got {synchronous!r}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._synchronous = synchronous.upper()
        self._queue: queue.SimpleQueue[
            tuple[_Operation, asyncio.Future[None], asyncio.AbstractEventLoop] | None
        ]
        self._queue = queue.SimpleQueue()
        self._reader = self._connect()
        self._writer_thread: threading.Thread | None = None
        self._closed = False
        self.commits = 0  # transactions committed, for tests and benchmarks of group commit

    def _connect(self) -> sqlite3.Connection:
        connection = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute(f"PRAGMA synchronous={self._synchronous}")
        connection.execute("PRAGMA busy_timeout=10000")
        connection.executescript(_SCHEMA)
        return connection

    # ------------------------------------------------------------ reads
    def load(self) -> Snapshot:
        """Read every resource and every subscription's unacknowledged messages."""
        snapshot = Snapshot()
        connection = self._reader
        for table, target in zip(
            _TABLES,
            (snapshot.topics, snapshot.subscriptions, snapshot.policies, snapshot.schemas),
            strict=True,
        ):
            message_class = resource_class(table)  # type: ignore[arg-type]
            for name, body in connection.execute(f"SELECT name, body FROM {table}"):
                target[name] = message_class.FromString(body)
        rows = connection.execute(
            "SELECT p.subscription, m.sequence, m.body FROM pending p JOIN messages m "
            "ON m.sequence = p.sequence ORDER BY p.subscription, p.sequence"
        )
        for subscription, sequence, body in rows:
            snapshot.pending.setdefault(subscription, []).append((sequence, PubsubMessage.FromString(body)))
        (last,) = connection.execute("SELECT COALESCE(MAX(sequence), 0) FROM messages").fetchone()
        (kept,) = connection.execute(
            "SELECT COALESCE(MAX(value), 1) FROM counters WHERE name = 'next_sequence'"
        ).fetchone()
        snapshot.next_sequence = max(last + 1, kept)
        return snapshot

    def messages(self, topic: str) -> list[tuple[int, Any]]:
        """Every message stored on ``topic``, in publish order (reads what has been committed)."""
        rows = self._reader.execute(
            "SELECT sequence, body FROM messages WHERE topic = ? ORDER BY sequence", (topic,)
        ).fetchall()
        return [(sequence, PubsubMessage.FromString(body)) for sequence, body in rows]

    # ------------------------------------------------------------ writes
    async def _write(self, operation: _Operation) -> None:
        if self._closed:
            raise RuntimeError("the store is closed")
        if self._writer_thread is None:
            self._writer_thread = threading.Thread(
                target=self._write_loop, name="hedgepub-sqlite", daemon=True
            )
            self._writer_thread.start()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._queue.put((operation, future, loop))
        # Shielded: a cancelled caller must not make us forget whether its write committed.
        await asyncio.shield(future)

    def _write_loop(self) -> None:
        connection = self._connect()
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    return
                group = [item]
                stop = False
                while len(group) < _MAX_GROUP:
                    try:
                        more = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if more is None:
                        stop = True
                        break
                    group.append(more)
                self._commit(connection, group)
                if stop:
                    return
        finally:
            connection.close()

    def _commit(self, connection: sqlite3.Connection, group: list[Any]) -> None:
        try:
            connection.execute("BEGIN IMMEDIATE")
            for operation, _, _ in group:
                operation(connection)
            connection.execute("COMMIT")
            self.commits += 1
        except Exception as error:
            if connection.in_transaction:
                connection.execute("ROLLBACK")
            if len(group) == 1:
                _resolve(group[0], error=error)
                return
            # One bad operation must not fail the others: retry each in a transaction of its own.
            for item in group:
                self._commit(connection, [item])
            return
        for item in group:
            _resolve(item)

    async def put(self, kind: ResourceKind, name: str, body: Any) -> None:
        """Create or replace a resource."""
        if kind not in _TABLES:
            raise ValueError(f"unknown resource kind {kind!r}")
        data = body.SerializeToString()

        def operation(connection: sqlite3.Connection) -> None:
            connection.execute(f"INSERT OR REPLACE INTO {kind} (name, body) VALUES (?, ?)", (name, data))

        await self._write(operation)

    async def delete(self, kind: ResourceKind, name: str) -> None:
        """Delete a resource (and a subscription's backlog)."""
        if kind not in _TABLES:
            raise ValueError(f"unknown resource kind {kind!r}")

        def operation(connection: sqlite3.Connection) -> None:
            connection.execute(f"DELETE FROM {kind} WHERE name = ?", (name,))
            if kind == "subscriptions":
                connection.execute("DELETE FROM pending WHERE subscription = ?", (name,))

        await self._write(operation)

    async def append(
        self, topic: str, messages: Sequence[tuple[int, Any]], subscriptions: Sequence[str]
    ) -> None:
        """Store messages and mark them unacknowledged on each subscription; returns after the commit."""
        rows = [(sequence, topic, message.SerializeToString()) for sequence, message in messages]
        pending = [(subscription, sequence) for subscription in subscriptions for sequence, _ in messages]

        def operation(connection: sqlite3.Connection) -> None:
            connection.executemany("INSERT INTO messages (sequence, topic, body) VALUES (?, ?, ?)", rows)
            if pending:
                connection.executemany(
                    "INSERT OR IGNORE INTO pending (subscription, sequence) VALUES (?, ?)", pending
                )

        await self._write(operation)

    async def ack(self, subscription: str, sequences: Iterable[int]) -> None:
        """Forget acknowledged messages of a subscription."""
        rows = [(subscription, sequence) for sequence in sequences]

        def operation(connection: sqlite3.Connection) -> None:
            connection.executemany("DELETE FROM pending WHERE subscription = ? AND sequence = ?", rows)

        await self._write(operation)

    async def clear(self) -> None:
        """Delete everything (message sequence numbers keep growing)."""

        def operation(connection: sqlite3.Connection) -> None:
            for table in (*_TABLES, "pending"):
                connection.execute(f"DELETE FROM {table}")
            # Keep the highest message so that sequence numbers, and so message IDs, are never reused.
            connection.execute("DELETE FROM messages WHERE sequence < (SELECT MAX(sequence) FROM messages)")
            connection.execute("UPDATE messages SET topic = ''")

        await self._write(operation)

    async def close(self) -> None:
        """Let every queued write commit, then stop the writer thread and close the files."""
        if self._closed:
            return
        self._closed = True
        thread = self._writer_thread
        if thread is not None:
            self._queue.put(None)
            await asyncio.get_running_loop().run_in_executor(None, thread.join)
        self._reader.close()

    def __repr__(self) -> str:
        return f"SqliteStore({str(self.path)!r}, synchronous={self._synchronous})"


def _resolve(item: Any, error: BaseException | None = None) -> None:
    _, future, loop = item

    def settle() -> None:
        if future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    # RuntimeError: the caller's loop is gone, so nobody is waiting any more.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(settle)
