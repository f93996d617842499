"""The durable :class:`~hedgepub.server._store.protocol.Store`: SQLite in WAL mode, one connection for writes.

Writes are group commits (:mod:`~hedgepub.server._store.group_commit`): those made during one step of the
event loop in one transaction, committed on the loop when the writer thread holds nothing and no fsync is
due, otherwise by the writer thread, which takes *everything* queued to it at that moment; many
concurrent Publish calls cost one commit, and the event loop never waits for an fsync (checkpoints, and
every commit under ``synchronous="FULL"``, are the thread's). Each caller's future resolves only after
the commit that holds its
change, so a Publish is answered only once its messages are on disk; a ``kill -9`` of the server loses
nothing it acknowledged. With ``synchronous=NORMAL`` (the default) a commit survives the process being
killed, not a power cut; ``synchronous="FULL"`` survives both, at the cost of an fsync per commit.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import itertools
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from hedgepub.server._store.batch import Batch
from hedgepub.server._store.group_commit import ON_THREAD, GroupCommitWriter, Operation, Statement
from hedgepub.server._store.protocol import HOLDING_KINDS, ResourceKind, Snapshot, Store, resource_class
from hedgepub.server._store.sqlite_schema import (
    APPEND,
    EXTEND_OFFSETS,
    HIGHEST,
    HOLDERS,
    KEEP,
    NEW_SPAN,
    OFFSETS,
    REFERENCE,
    SPANS,
    TABLES,
    connect,
    covering_spans,
    drop_holder,
    holding_first,
    keep_counter_above,
    migrate,
    split_all_spans,
    split_spans,
    unreference,
)

#: The first sequence of the batch holding the sequence the SQL expression ``{}`` gives (or of the batch
#: below it, if none holds it): the stored batch with the greatest first sequence not above it.
_HOLDING = "SELECT first FROM batches WHERE first <= {} ORDER BY first DESC LIMIT 1"


def _spanned(spans: Iterable[tuple[int, int]], low: int, high: int) -> Iterator[tuple[int, int]]:
    """The (sequence, first of its batch) of every message the spans (first, last) cover in
    ``[low, high)``, in order."""
    for first, last in spans:
        if first >= high:
            return
        for sequence in range(max(first, low), min(last + 1, high)):
            yield sequence, first


class SqliteStore(Store):
    """A :class:`~hedgepub.server._store.protocol.Store` in one SQLite file (WAL), with group commit.

    A Publish request's messages are one batch: a row of ``batches`` (sequences, topic, publish time, live
    references) and one of ``bodies`` (the request serialized once); appending does no Python work per
    message. Each subscription references a new batch's messages by one row of ``spans`` (its id and the
    batch's first sequence); once one of them is acknowledged, or gets a delivery attempt recorded, the
    span becomes a row of ``refs`` per message it has not acknowledged (subscription id, sequence, and the
    deliveries that ended unacknowledged, counted under a dead-letter policy), generated inside SQLite;
    a span acknowledged whole goes as one row. The last reference to a batch's messages takes the batch
    with it. New files use ``auto_vacuum=INCREMENTAL``: freed pages are reused, and once they are a
    quarter of the file the writer hands them back in small steps.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        synchronous: str = "NORMAL",
        keep_unsubscribed: bool = False,
        cache_messages: int = 10_000,
        cache_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        if synchronous.upper() not in {"OFF", "NORMAL", "FULL", "EXTRA"}:
            raise ValueError(f"synchronous must be OFF, NORMAL, FULL or EXTRA; got {synchronous!r}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.keep_unsubscribed = keep_unsubscribed
        self._synchronous = synchronous.upper()
        self._reader = self._connect()
        migrate(self._reader, keep_unsubscribed=keep_unsubscribed)
        #: subscription name -> its id in ``refs`` (owned by the event loop thread).
        self._ids: dict[str, int] = dict(self._reader.execute("SELECT name, id FROM subscription_ids"))
        (last_id,) = self._reader.execute("SELECT COALESCE(MAX(id), 0) FROM subscription_ids").fetchone()
        self._next_id = last_id + 1
        #: Every write goes through its thread, folded into group commits.
        # Commits on the event loop when they need no fsync (see group_commit); FULL and EXTRA sync each.
        self._writer = GroupCommitWriter(self._connect, on_loop=self._synchronous in {"OFF", "NORMAL"})
        # Batches parsed for recent pages (by first sequence), shared by every subscription that reads
        # them: with many subscriptions on one topic, one parsed copy serves all of them instead of one
        # copy each. Bounded by the messages they hold and by their serialized bytes.
        self._parsed: collections.OrderedDict[int, tuple[Batch, int]] = collections.OrderedDict()
        self._cache_messages = cache_messages
        self._cache_bytes = cache_bytes
        self._parsed_messages = 0
        self._parsed_bytes = 0

    def _connect(self) -> sqlite3.Connection:
        return connect(self.path, self._synchronous)

    # ------------------------------------------------------------ reads
    def load(self) -> Snapshot:
        """Read every resource and the sequence counter (backlogs are read in pages later)."""
        snapshot = Snapshot()
        connection = self._reader
        for table, target in zip(
            TABLES,
            (
                snapshot.topics,
                snapshot.subscriptions,
                snapshot.policies,
                snapshot.schemas,
                snapshot.snapshots,
            ),
            strict=True,
        ):
            message_class = resource_class(table)  # type: ignore[arg-type]  # TABLES are kinds, typed str
            for name, body in connection.execute(f"SELECT name, body FROM {table}"):
                target[name] = message_class.FromString(body)
        (last,) = connection.execute(f"SELECT COALESCE(({HIGHEST}), 0)").fetchone()
        (kept,) = connection.execute(
            "SELECT COALESCE(MAX(value), 1) FROM counters WHERE name = 'next_sequence'"
        ).fetchone()
        snapshot.next_sequence = max(last + 1, kept)
        snapshot.activity = dict(connection.execute("SELECT subscription, active_ns FROM activity"))
        return snapshot

    def pending(self, subscription: str, after: int, limit: int, max_bytes: int = 0) -> list[tuple[int, Any]]:
        """A page of the messages ``subscription`` references above ``after`` (what has been committed);
        with ``max_bytes``, rows stop being read once the page holds that many bytes (one row at least).

        Each batch a page touches is parsed once (its body, one C call) and kept in a cache bounded by
        messages and by bytes (``cache_bytes``), shared by every subscription reading the same messages.
        """
        identifier = self._ids.get(subscription)
        if identifier is None:
            return []
        reader = self._reader
        rows = reader.execute(
            f"SELECT r.sequence, ({_HOLDING.format('r.sequence')}) FROM refs r "
            "WHERE r.subscription = ? AND r.sequence > ? ORDER BY r.sequence LIMIT ?",
            (identifier, after, limit),
        )
        spans = reader.execute(SPANS, (identifier, holding_first(reader, after + 1), 2**62))
        page = []
        read = 0
        batch: Batch | None = None
        # Rows and spans never cover one message twice; both are stepped as needed: nothing past the
        # limit or the byte bound is read.
        merged = heapq.merge(rows, _spanned(spans, after + 1, 2**62))
        for sequence, first in itertools.islice(merged, limit):
            if batch is None or batch.first != first:
                batch = self._batch(first)
            if batch is None or sequence >= batch.end:
                continue  # a reference without its batch: nothing to deliver (the triggers never leave one)
            message = batch.message(sequence)
            page.append((sequence, message))
            if max_bytes:
                read += message.ByteSize()
                if read >= max_bytes:
                    break
        rows.close()
        spans.close()
        return page

    def _batch(self, first: int | None) -> Batch | None:
        """The stored batch starting at ``first``, parsed (from the cache, or read and cached)."""
        if first is None:
            return None
        cache = self._parsed
        cached = cache.get(first)
        if cached is not None:
            return cached[0]
        row = self._reader.execute(
            "SELECT b.topic, b.publish_ns, d.body FROM batches b JOIN bodies d ON d.first = b.first "
            "WHERE b.first = ?",
            (first,),
        ).fetchone()
        if row is None:
            return None
        topic, publish_ns, body = row
        batch = Batch.from_body(first, topic, publish_ns, body)
        cache[first] = (batch, len(body))
        self._parsed_messages += len(batch)
        self._parsed_bytes += len(body)
        # The batch just read stays (a page needs it) even when it alone is over a bound.
        while len(cache) > 1 and (
            self._parsed_messages > self._cache_messages or self._parsed_bytes > self._cache_bytes
        ):
            _, (evicted, size) = cache.popitem(last=False)
            self._parsed_messages -= len(evicted)
            self._parsed_bytes -= size
        return batch

    def messages(self, topic: str) -> list[tuple[int, Any]]:
        """Every message still stored on ``topic``, in publish order (reads what has been committed).

        A scan of all batches: this serves tests and inspection, and an index on topics would cost
        every Publish.
        """
        connection = self._reader
        rows = connection.execute(
            "SELECT b.first, b.last, b.publish_ns, d.body FROM batches b JOIN bodies d ON d.first = b.first "
            "WHERE b.topic = ? ORDER BY b.first",
            (topic,),
        ).fetchall()
        found: list[tuple[int, Any]] = []
        for first, last, publish_ns, body in rows:
            batch = Batch.from_body(first, topic, publish_ns, body)
            if self._spanned(first):
                found.extend((sequence, batch.message(sequence)) for sequence in range(first, last + 1))
                continue
            # The batch's messages some holder still references (one seek per holder).
            kept = connection.execute(
                f"SELECT DISTINCT sequence FROM refs WHERE subscription IN ({HOLDERS}) "
                "AND sequence BETWEEN ? AND ? ORDER BY sequence",
                (first, last),
            ).fetchall()
            found.extend((sequence, batch.message(sequence)) for (sequence,) in kept)
        return found

    def _spanned(self, first: int) -> bool:
        """Whether some holder's span covers the batch starting at ``first`` (one seek per holder)."""
        return (
            self._reader.execute(
                f"SELECT 1 FROM spans WHERE subscription IN ({HOLDERS}) AND first = ? LIMIT 1", (first,)
            ).fetchone()
            is not None
        )

    def file_bytes(self) -> int:
        """Size of the database file and its WAL on disk, in bytes."""
        total = 0
        for suffix in ("", "-wal"):
            with contextlib.suppress(FileNotFoundError):
                total += (self.path.parent / (self.path.name + suffix)).stat().st_size
        return total

    # ------------------------------------------------------------ writes

    async def put(self, kind: ResourceKind, name: str, body: Any) -> None:
        """Create or replace a resource (a new subscription gets the id its references carry)."""
        if kind not in TABLES:
            raise ValueError(f"unknown resource kind {kind!r}")
        data = body.SerializeToString()
        identifier = self._new_identifier(name) if kind in HOLDING_KINDS else None

        def operation(connection: sqlite3.Connection) -> None:
            connection.execute(f"INSERT OR REPLACE INTO {kind} (name, body) VALUES (?, ?)", (name, data))
            if identifier is not None:
                connection.execute(
                    "INSERT OR REPLACE INTO subscription_ids (id, name) VALUES (?, ?)", (identifier, name)
                )

        await self._write(operation)

    async def delete(self, kind: ResourceKind, name: str) -> None:
        """Delete a resource; a subscription's references go with it, and the messages only they kept."""
        if kind not in TABLES:
            raise ValueError(f"unknown resource kind {kind!r}")
        # Forgotten at once, so that no append called from now on references the subscription.
        identifier = self._ids.pop(name, None) if kind in HOLDING_KINDS else None

        def operation(connection: sqlite3.Connection) -> None:
            connection.execute(f"DELETE FROM {kind} WHERE name = ?", (name,))
            if kind == "subscriptions":
                connection.execute("DELETE FROM activity WHERE subscription = ?", (name,))
            if identifier is not None:
                drop_holder(connection, identifier)

        await self._write(operation, ON_THREAD if identifier is not None else 0)

    # ------------------------------------------------------------ replay: holders of references
    def _new_identifier(self, holder: str) -> int | None:
        """A new id for ``holder`` (its row is the caller's to write), or ``None`` if it has one."""
        if holder in self._ids:
            return None
        identifier = self._ids[holder] = self._next_id
        self._next_id += 1
        return identifier

    async def register(self, holder: str) -> None:
        """Give ``holder`` an id its references carry (idempotent)."""
        identifier = self._new_identifier(holder)
        if identifier is None:
            return

        def operation(connection: sqlite3.Connection) -> None:
            connection.execute(
                "INSERT OR REPLACE INTO subscription_ids (id, name) VALUES (?, ?)", (identifier, holder)
            )

        await self._write(operation)

    async def release(self, holder: str) -> None:
        """Drop ``holder``'s references and the messages only they kept."""
        identifier = self._ids.pop(holder, None)
        if identifier is None:
            return

        def operation(connection: sqlite3.Connection) -> None:
            drop_holder(connection, identifier)

        await self._write(operation, ON_THREAD)

    async def reference(self, holder: str, sequences: Iterable[int]) -> None:
        """Reference stored messages from ``holder`` (those no longer stored are skipped)."""
        await self.register(holder)
        identifier = self._ids[holder]
        rows = [(identifier, sequence) for sequence in sequences]
        if not rows:
            return

        def operation(connection: sqlite3.Connection) -> None:
            for statement in REFERENCE:
                connection.executemany(statement, rows)

        await self._write(operation, 64 * len(rows))

    async def put_snapshot(self, name: str, body: Any, source: str) -> None:
        """The snapshot's row, its id and its references to what ``source`` references, in one
        transaction: a crash leaves no snapshot or all of it (a retried CreateSnapshot then finds either
        nothing or the whole snapshot, never one that holds nothing). The references are copied inside
        SQLite, as of the commit, so a backlog of any size costs no Python work."""
        data = body.SerializeToString()
        identifier = self._new_identifier(name)
        if identifier is None:
            identifier = self._ids[name]
        source_id = self._ids.get(source)

        def operation(connection: sqlite3.Connection) -> None:
            connection.execute("INSERT OR REPLACE INTO snapshots (name, body) VALUES (?, ?)", (name, data))
            connection.execute(
                "INSERT OR REPLACE INTO subscription_ids (id, name) VALUES (?, ?)", (identifier, name)
            )
            if source_id is None:
                return
            # Both as a row per message, so that the copy below sees every reference (a backlog's
            # spans become rows here, as the snapshot's own references would be anyway).
            split_all_spans(connection, source_id)
            split_all_spans(connection, identifier)
            # Counted first, per batch, for the messages the snapshot does not reference yet (a publish
            # committed in the same group may have referenced it already); then the references are copied.
            new = (
                "FROM refs r WHERE r.subscription = ?1 AND r.sequence BETWEEN batches.first AND batches.last "
                "AND NOT EXISTS (SELECT 1 FROM refs WHERE subscription = ?2 AND sequence = r.sequence)"
            )
            connection.execute(
                f"UPDATE batches SET refs = refs + (SELECT COUNT(*) {new}) WHERE EXISTS (SELECT 1 {new})",
                (source_id, identifier),
            )
            connection.execute(
                "INSERT OR IGNORE INTO refs (subscription, sequence) "
                "SELECT ?2, sequence FROM refs WHERE subscription = ?1",
                (source_id, identifier),
            )

        await self._write(operation, ON_THREAD)

    def referenced(self, holder: str, low: int = 0, high: int | None = None) -> list[int]:
        """The sequences ``holder`` references in ``[low, high)`` (what has been committed)."""
        identifier = self._ids.get(holder)
        if identifier is None:
            return []
        reader = self._reader
        end = high if high is not None else 2**62
        rows = reader.execute(
            "SELECT sequence, 0 FROM refs WHERE subscription = ? AND sequence >= ? AND sequence < ? "
            "ORDER BY sequence",
            (identifier, low, end),
        ).fetchall()
        spans = reader.execute(SPANS, (identifier, holding_first(reader, low), end)).fetchall()
        return [sequence for sequence, _ in heapq.merge(rows, _spanned(spans, low, end))]

    async def put_leases(self, subscription: str, leases: Sequence[tuple[int, str, int]]) -> None:
        """Record exactly-once leases (replacing earlier ones of the same messages)."""
        identifier = self._ids.get(subscription)
        if identifier is None or not leases:
            return
        rows = [(identifier, sequence, ack_id, deadline) for sequence, ack_id, deadline in leases]

        def operation(connection: sqlite3.Connection) -> None:
            connection.executemany(
                "INSERT OR REPLACE INTO leases (subscription, sequence, ack_id, deadline_ns) "
                "VALUES (?, ?, ?, ?)",
                rows,
            )

        await self._write(operation, 64 * len(rows))

    async def drop_leases(self, subscription: str, sequences: Iterable[int]) -> None:
        """Forget exactly-once leases."""
        identifier = self._ids.get(subscription)
        rows = [(identifier, sequence) for sequence in sequences]
        if identifier is None or not rows:
            return

        def operation(connection: sqlite3.Connection) -> None:
            connection.executemany("DELETE FROM leases WHERE subscription = ? AND sequence = ?", rows)

        await self._write(operation, 64 * len(rows))

    def leases(self, subscription: str) -> list[tuple[int, str, int]]:
        """The recorded leases of a subscription (what has been committed)."""
        identifier = self._ids.get(subscription)
        if identifier is None:
            return []
        rows = self._reader.execute(
            "SELECT sequence, ack_id, deadline_ns FROM leases WHERE subscription = ? ORDER BY sequence",
            (identifier,),
        ).fetchall()
        return [(sequence, ack_id, deadline) for sequence, ack_id, deadline in rows]

    async def record_attempts(self, subscription: str, attempts: Sequence[tuple[int, int]]) -> None:
        """Write delivery attempts onto the subscription's references (the rows acknowledging deletes), so
        a count costs no row of its own and goes with its message; references already gone are skipped."""
        identifier = self._ids.get(subscription)
        if identifier is None or not attempts:
            return
        rows = [(count, identifier, sequence) for sequence, count in attempts]
        sequences = sorted({sequence for sequence, _ in attempts})

        def operation(connection: sqlite3.Connection) -> None:
            # A count needs the message's own row: spans over these messages become rows first.
            whole, partial = covering_spans(connection, identifier, sequences)
            split_spans(connection, identifier, [first for first, _ in whole] + partial)
            connection.executemany(
                "UPDATE refs SET attempts = ? WHERE subscription = ? AND sequence = ?", rows
            )

        await self._write(operation, 64 * len(rows))

    def attempts(self, subscription: str, after: int, through: int) -> dict[int, int]:
        """The delivery attempts recorded in ``(after, through]`` (what has been committed)."""
        identifier = self._ids.get(subscription)
        if identifier is None:
            return {}
        rows = self._reader.execute(
            "SELECT sequence, attempts FROM refs WHERE subscription = ? AND sequence > ? AND sequence <= ? "
            "AND attempts > 0",
            (identifier, after, through),
        ).fetchall()
        return dict(rows)

    async def put_activity(self, activity: Sequence[tuple[str, int]]) -> None:
        """Record when subscriptions were last active (one small row each, rewritten at most about once a
        minute by the core); names without a subscription row are skipped."""
        rows = list(activity)
        if not rows:
            return

        def operation(connection: sqlite3.Connection) -> None:
            connection.executemany(
                "INSERT OR REPLACE INTO activity (subscription, active_ns) SELECT ?1, ?2 "
                "WHERE EXISTS (SELECT 1 FROM subscriptions WHERE name = ?1)",
                rows,
            )

        await self._write(operation)

    def first_sequence_at(self, publish_ns: int) -> int | None:
        """Binary search on ``batches`` by first sequence, reading the publish time of each probe; then
        the first message of the batch found that is still stored."""
        connection = self._reader

        def first_from(sequence: int) -> Any:
            return connection.execute(
                "SELECT first, last, publish_ns FROM batches WHERE first >= ? ORDER BY first LIMIT 1",
                (sequence,),
            ).fetchone()

        lowest, highest = connection.execute("SELECT MIN(first), MAX(first) FROM batches").fetchone()
        if lowest is None:
            return None
        # Smallest s such that the first batch at or after s is published at or after the time (or none).
        low, high = lowest, highest + 1
        while low < high:
            middle = (low + high) // 2
            row = first_from(middle)
            if row is not None and row[2] < publish_ns:
                low = row[0] + 1
            else:
                high = middle
        row = first_from(low)
        if row is None:
            return None
        # A stored batch holds at least one stored message (it goes with its last reference).
        if self._spanned(row[0]):
            return int(row[0])
        (sequence,) = connection.execute(
            f"SELECT MIN(sequence) FROM refs WHERE subscription IN ({HOLDERS}) AND sequence BETWEEN ? AND ?",
            (row[0], row[1]),
        ).fetchone()
        return sequence if sequence is not None else row[0]

    async def append(self, batch: Batch, subscriptions: Sequence[str]) -> None:
        """Store a batch once and reference its messages from each subscription; returns after the commit.

        One row for the batch and one for its body (serialized here, on the caller's thread, before anyone
        stamps its messages in place), and one span per holder over all its messages: nothing is done or
        written per message. Batch, body and the first holder's span are one statement (:data:`APPEND`, a
        trigger on a view), each further holder's span one more.
        """
        if not len(batch):
            return
        # Each holder once (dict.fromkeys keeps the order), so that the count below is right.
        ids = list(dict.fromkeys(self._ids[name] for name in subscriptions if name in self._ids))
        first, last = batch.first, batch.end - 1
        if not ids and not self.keep_unsubscribed:
            # Nobody will ever read them; only the sequence counter must remember that they had IDs.
            await self.reserve(last)
            return
        ids = ids or [KEEP]
        row = (first, last, batch.topic, batch.publish_ns, len(batch) * len(ids), batch.body(), ids[0])
        if len(ids) == 1 and len(batch) <= OFFSETS:
            # The whole append is one statement, which a commit of its own needs no BEGIN and COMMIT for.
            await self._write(Statement(APPEND, row), len(row[5]))
            return
        longer = len(batch) > OFFSETS  # than any Publish request: perhaps than the offsets stored

        def operation(connection: sqlite3.Connection) -> None:
            if longer:
                connection.execute(EXTEND_OFFSETS, (len(batch),))
            connection.execute(APPEND, row)
            connection.executemany(NEW_SPAN, [(identifier, first) for identifier in ids[1:]])

        await self._write(operation, len(row[5]) + 64 * len(ids))

    async def reserve(self, last: int) -> None:
        """Keep the stored next sequence above ``last`` (IDs given to messages that are not stored)."""

        def count(connection: sqlite3.Connection) -> None:
            keep_counter_above(connection, "SELECT ?", last)

        await self._write(count)

    async def ack(self, subscription: str, sequences: Iterable[int]) -> None:
        """Drop acknowledged references, and the messages nothing references any more."""
        identifier = self._ids.get(subscription)
        if identifier is None:
            return
        rows = [(identifier, sequence) for sequence in sequences]
        if not rows:
            return

        def operation(connection: sqlite3.Connection) -> None:
            # Retained acknowledged messages (retain_acked_messages, snapshots) would keep the reference
            # here, marked acknowledged with its time, instead of deleting it.
            unreference(connection, rows)

        await self._write(operation, 64 * len(rows))

    async def clear(self) -> None:
        """Delete everything (message sequence numbers keep growing)."""
        self._ids.clear()
        self._parsed.clear()
        self._parsed_messages = self._parsed_bytes = 0

        def operation(connection: sqlite3.Connection) -> None:
            keep_counter_above(connection, HIGHEST)
            # Batches before references, so that the references' trigger finds no batch left to count.
            for table in (
                *TABLES,
                "batches",
                "bodies",
                "refs",
                "spans",
                "leases",
                "activity",
                "subscription_ids",
            ):
                connection.execute(f"DELETE FROM {table}")

        await self._write(operation, ON_THREAD)

    @property
    def commits(self) -> int:
        """Transactions committed (for tests and benchmarks of group commit)."""
        return self._writer.commits

    async def _write(self, operation: Operation, size: int = 0) -> None:
        await self._writer.write(operation, size)

    async def close(self) -> None:
        """Let every queued write commit, then stop the writer thread and close the files."""
        await self._writer.close()
        self._reader.close()

    def __repr__(self) -> str:
        return f"SqliteStore({str(self.path)!r}, synchronous={self._synchronous})"
