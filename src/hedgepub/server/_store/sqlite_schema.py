"""The file of the :class:`~hedgepub.server._store.sqlite.SqliteStore`: its tables, how a connection to
it is set up, how a file of an earlier layout is brought to this one, and the statements that keep each
batch's references counted (run on the writer thread's connection).

The unit of storage is a batch (the messages of one Publish request, see
:class:`~hedgepub.server._store.batch.Batch`): one row of ``batches`` (its sequences, topic, publish time
and live reference count) and one of ``bodies`` (its messages, serialized as one ``PublishRequest``).
Appending writes nothing per message: each holder references the new batch's messages by one row of
``spans`` (holder, first sequence). A span becomes a reference per message in ``refs`` (which also
counts delivery attempts) only when the holder acknowledges part of the batch, gets an attempt recorded
or is copied into a snapshot (:func:`split_spans`, generated inside SQLite from ``offsets``); a span
acknowledged whole goes as one row. For a holder and a batch there is a span or rows, never both. A
message is stored while some holder references it; a batch goes, by trigger, when its last reference
does.
"""

from __future__ import annotations

import bisect
import sqlite3
from pathlib import Path
from typing import Any

from hedgepub.server._store.batch import PublishRequest
from hedgepub.server._store.protocol import PubsubMessage

__all__ = [
    "APPEND",
    "EXTEND_OFFSETS",
    "HIGHEST",
    "HOLDERS",
    "KEEP",
    "NEW_SPAN",
    "OFFSETS",
    "REFERENCE",
    "SCHEMA",
    "SPANS",
    "TABLES",
    "connect",
    "covering_spans",
    "drop_holder",
    "drop_spans",
    "holding_first",
    "keep_counter_above",
    "migrate",
    "split_all_spans",
    "split_spans",
    "unreference",
]

SCHEMA = """
CREATE TABLE IF NOT EXISTS topics (name TEXT PRIMARY KEY, body BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS subscriptions (name TEXT PRIMARY KEY, body BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS policies (name TEXT PRIMARY KEY, body BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS schemas (name TEXT PRIMARY KEY, body BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS snapshots (name TEXT PRIMARY KEY, body BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS subscription_ids (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE);
CREATE TABLE IF NOT EXISTS refs (
    subscription INTEGER NOT NULL,
    sequence INTEGER NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (subscription, sequence)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS activity (subscription TEXT PRIMARY KEY, active_ns INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    subscription INTEGER NOT NULL,
    sequence INTEGER NOT NULL,
    ack_id TEXT NOT NULL,
    deadline_ns INTEGER NOT NULL,
    PRIMARY KEY (subscription, sequence)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS batches (
    first INTEGER PRIMARY KEY,
    last INTEGER NOT NULL,
    topic TEXT NOT NULL,
    publish_ns INTEGER NOT NULL,
    refs INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS bodies (first INTEGER PRIMARY KEY, body BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS offsets (n INTEGER PRIMARY KEY);
CREATE TRIGGER IF NOT EXISTS reference_dropped AFTER DELETE ON refs BEGIN
    UPDATE batches SET refs = refs - 1
    WHERE first = (SELECT first FROM batches WHERE first <= old.sequence ORDER BY first DESC LIMIT 1)
    AND last >= old.sequence;
END;
CREATE TRIGGER IF NOT EXISTS batch_unreferenced AFTER UPDATE OF refs ON batches WHEN new.refs <= 0 BEGIN
    DELETE FROM batches WHERE first = new.first;
END;
CREATE TRIGGER IF NOT EXISTS batch_deleted AFTER DELETE ON batches BEGIN
    DELETE FROM bodies WHERE first = old.first;
END;
CREATE VIEW IF NOT EXISTS appends (first, last, topic, publish_ns, refs, body, holder) AS
    SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL WHERE 0;
CREATE TABLE IF NOT EXISTS spans (
    subscription INTEGER NOT NULL,
    first INTEGER NOT NULL,
    PRIMARY KEY (subscription, first)
) WITHOUT ROWID;
CREATE TRIGGER IF NOT EXISTS append_span INSTEAD OF INSERT ON appends BEGIN
    INSERT INTO batches (first, last, topic, publish_ns, refs)
    VALUES (new.first, new.last, new.topic, new.publish_ns, new.refs);
    INSERT INTO bodies (first, body) VALUES (new.first, new.body);
    INSERT INTO spans (subscription, first) VALUES (new.holder, new.first);
END;
"""
# Why the body has a table of its own: SQLite writes a whole row again on UPDATE, so a count beside a
# 10 KB body made every acknowledgement rebuild the body's record (4.4 against 2.6 us per acknowledged
# message, measured with the SQL alone). Why triggers: every way a reference goes (ack, a dropped holder,
# a retention's expiry) then counts it, in C, without a statement of its own per path. A span is counted
# as its batch's length, by the statements that add or drop it (:func:`drop_spans`), not by a trigger:
# splitting it into rows must leave the count as it is.

#: The highest sequence of a stored batch (``NULL`` if none): what the sequence counter must stay above.
HIGHEST = "SELECT last FROM batches ORDER BY first DESC LIMIT 1"
#: Holder ?1 references every message of the new batch whose first sequence is ?2 (a span: one row for
#: the batch, where a reference row per message cost about 0.4 us per message and a page per commit).
NEW_SPAN = "INSERT INTO spans (subscription, first) VALUES (?, ?)"
#: A batch, its body and one holder's span over its messages in one statement (the trigger on the
#: view ``appends``): with one holder a Publish is a single statement, which the writer commits on its
#: own (see :class:`~hedgepub.server._store.group_commit.Statement`).
APPEND = (
    "INSERT INTO appends (first, last, topic, publish_ns, refs, body, holder) VALUES (?, ?, ?, ?, ?, ?, ?)"
)
#: How many ``offsets`` a file starts with: a Publish request's most messages.
OFFSETS = 1000
#: Makes ``offsets`` hold 0 .. ?1 - 1 (for a batch longer than any before; a no-op otherwise).
EXTEND_OFFSETS = (
    "WITH RECURSIVE s(x) AS (SELECT 0 UNION ALL SELECT x + 1 FROM s WHERE x + 1 < ?1) "
    "INSERT OR IGNORE INTO offsets (n) SELECT x FROM s"
)
#: Every holder's id (``KEEP`` is nobody's): ``refs`` has no index on ``sequence`` (it would cost every
#: Publish), so finding a message's references is one primary-key seek per holder.
HOLDERS = "SELECT id FROM subscription_ids UNION ALL SELECT 0"


def _holding(sequence: str) -> str:
    """The first sequence of the stored batch that holds the message whose sequence is the SQL expression
    ``sequence`` (or of the batch below it, if none holds it; ``NULL`` if there is none)."""
    return f"(SELECT first FROM batches WHERE first <= {sequence} ORDER BY first DESC LIMIT 1)"


def _stored(sequence: str) -> str:
    """An SQL condition: the message whose sequence is the SQL expression ``sequence`` is stored (some
    holder references it, by a row or by a span over its batch; its batch may outlive it, holding its
    other messages)."""
    return (
        f"(EXISTS (SELECT 1 FROM refs WHERE subscription IN ({HOLDERS}) AND sequence = {sequence}) "
        f"OR EXISTS (SELECT 1 FROM batches b WHERE b.first = {_holding(sequence)} AND b.last >= {sequence} "
        f"AND EXISTS (SELECT 1 FROM spans WHERE subscription IN ({HOLDERS}) AND first = b.first)))"
    )


# How a holder (?1) comes to reference a stored message (?2) it did not reference yet, in this order:
# the batch's count goes up by one, then the reference is written (both skip a message no longer stored,
# or one the holder's span over its batch references already).
_SPANNED = f"EXISTS (SELECT 1 FROM spans WHERE subscription = ?1 AND first = {_holding('?2')})"
_REFERENCED = f"(EXISTS (SELECT 1 FROM refs WHERE subscription = ?1 AND sequence = ?2) OR {_SPANNED})"
REFERENCE = (
    "UPDATE batches SET refs = refs + 1 "
    f"WHERE first = {_holding('?2')} AND last >= ?2 AND {_stored('?2')} AND NOT {_REFERENCED}",
    "INSERT OR IGNORE INTO refs (subscription, sequence) SELECT ?1, ?2 "
    f"WHERE {_stored('?2')} AND NOT {_SPANNED}",
)
#: Holder ?1's spans over the batches whose first sequence is in ?2 .. ?3, with each batch's last
#: sequence, in order.
SPANS = (
    "SELECT s.first, b.last FROM spans s JOIN batches b ON b.first = s.first "
    "WHERE s.subscription = ?1 AND s.first BETWEEN ?2 AND ?3 ORDER BY s.first"
)
TABLES = ("topics", "subscriptions", "policies", "schemas", "snapshots")
#: The reference that keeps a message published to a topic without subscriptions (``keep_unsubscribed``).
KEEP = 0
#: Most messages one migrated batch holds (the earlier layout's messages are regrouped).
_MIGRATED_BATCH = 1000


def connect(path: Path, synchronous: str) -> sqlite3.Connection:
    """A connection to the store's file at ``path``, set up for it, its tables created if new."""
    connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    # Only takes effect on a new, empty file (before the first table); an older file keeps its mode.
    connection.execute("PRAGMA auto_vacuum=INCREMENTAL")
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute(f"PRAGMA synchronous={synchronous}")
    connection.execute("PRAGMA busy_timeout=10000")
    # The WAL is truncated back to this after a checkpoint, so a burst does not leave a large file.
    connection.execute("PRAGMA journal_size_limit=16777216")
    # Checkpoints (copying the WAL into the database, with an fsync) every 16 MiB rather than SQLite's
    # default 4 MiB: a quarter as many, which the ingest rate shows.
    connection.execute("PRAGMA wal_autocheckpoint=4096")
    connection.executescript(SCHEMA)
    (count,) = connection.execute("SELECT COUNT(*) FROM offsets").fetchone()
    if count < OFFSETS:  # a new file
        connection.execute(EXTEND_OFFSETS, (OFFSETS,))
    return connection


def migrate(connection: sqlite3.Connection, *, keep_unsubscribed: bool) -> None:
    """Bring a file of an earlier layout to this one.

    The layout just before this one (batches, with a reference row per message and holder) needs only
    its append trigger replaced: its rows are references as they are, and ``spans`` starts empty.

    The layouts before that kept a ``messages`` row per message (its stamped ``PubsubMessage``). The
    first kept a ``pending`` row per (subscription name, sequence) and every message for good; the next
    one found a message's references through an index on ``refs (sequence)``; the one after that counted
    them in ``counts`` (a row per message with more than one) but had no ``attempts`` column in ``refs``
    (its messages start from no recorded attempt, as they did at every restart then); the last one had
    the column. Each is brought to the last per-message layout, whose messages then become batches
    (:func:`_batch_messages`). Tables added since (``activity``, ``spans``) need nothing here: the
    schema script creates them, empty.
    """
    # The layout before spans generated a reference row per message on append, by this trigger.
    connection.execute("DROP TRIGGER IF EXISTS append_batch")
    columns = {row[1] for row in connection.execute("PRAGMA table_info(refs)")}
    if "attempts" not in columns:
        # A schema change only: existing rows read the default without being rewritten.
        connection.execute("ALTER TABLE refs ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0")
    tables = {name for (name,) in connection.execute("SELECT name FROM sqlite_master")}
    if "messages" not in tables:
        return
    connection.execute("BEGIN IMMEDIATE")
    connection.execute(
        "CREATE TABLE IF NOT EXISTS counts (sequence INTEGER PRIMARY KEY, refs INTEGER NOT NULL)"
    )
    if "refs_by_sequence" in tables:
        connection.execute(
            "INSERT OR REPLACE INTO counts (sequence, refs) "
            "SELECT sequence, COUNT(*) FROM refs GROUP BY sequence HAVING COUNT(*) > 1"
        )
        connection.execute("DROP INDEX refs_by_sequence")
    if "pending" in tables:
        _reference_pending(connection, keep_unsubscribed=keep_unsubscribed)
    _batch_messages(connection)
    connection.execute("COMMIT")


def _reference_pending(connection: sqlite3.Connection, *, keep_unsubscribed: bool) -> None:
    """The first layout's ``pending`` rows become references, and what nobody references goes."""
    connection.execute("INSERT OR IGNORE INTO subscription_ids (name) SELECT name FROM subscriptions")
    connection.execute(
        "INSERT OR IGNORE INTO refs (subscription, sequence) SELECT i.id, p.sequence FROM pending p "
        "JOIN subscription_ids i ON i.name = p.subscription"
    )
    connection.execute(
        "INSERT OR REPLACE INTO counters (name, value) SELECT 'next_sequence', "
        "MAX(COALESCE((SELECT MAX(sequence) FROM messages), 0) + 1, "
        "COALESCE((SELECT value FROM counters WHERE name = 'next_sequence'), 1))"
    )
    unreferenced = "sequence NOT IN (SELECT sequence FROM refs)"
    if keep_unsubscribed:
        connection.execute(
            f"INSERT INTO refs (subscription, sequence) SELECT {KEEP}, sequence FROM messages "
            f"WHERE {unreferenced}"
        )
    else:
        connection.execute(f"DELETE FROM messages WHERE {unreferenced}")
    connection.execute(
        "INSERT INTO counts (sequence, refs) "
        "SELECT sequence, COUNT(*) FROM refs GROUP BY sequence HAVING COUNT(*) > 1"
    )
    connection.execute("DROP TABLE pending")
    connection.execute("DROP INDEX IF EXISTS messages_by_topic")


def _batch_messages(connection: sqlite3.Connection) -> None:
    """The per-message layout's messages become batches, in the caller's transaction.

    Consecutive messages of one topic with one publish time (what one Publish wrote) make one batch, of
    at most ``_MIGRATED_BATCH`` messages; a batch's count is the sum of its messages' references (the
    ``counts`` row, else the one reference a stored message had). Read in slices, so a large file is
    never in memory at once; done once, then ``messages`` and ``counts`` are dropped.
    """
    keep_counter_above(connection, "SELECT MAX(sequence) FROM messages")
    after = 0
    group: list[tuple[int, str, int, Any, int]] = []

    def flush() -> None:
        if not group:
            return
        first, topic, publish_ns = group[0][0], group[0][1], group[0][2]
        body = PublishRequest(messages=[row[3] for row in group]).SerializeToString()
        connection.execute(
            "INSERT INTO batches (first, last, topic, publish_ns, refs) VALUES (?, ?, ?, ?, ?)",
            (first, group[-1][0], topic, publish_ns, sum(row[4] for row in group)),
        )
        connection.execute("INSERT INTO bodies (first, body) VALUES (?, ?)", (first, body))
        group.clear()

    while True:
        rows = connection.execute(
            "SELECT m.sequence, m.topic, m.body, COALESCE(c.refs, 1) FROM messages m LEFT JOIN counts c "
            "ON c.sequence = m.sequence WHERE m.sequence > ? ORDER BY m.sequence LIMIT 10000",
            (after,),
        ).fetchall()
        if not rows:
            break
        for sequence, topic, body, references in rows:
            message = PubsubMessage.FromString(body)
            stamp = message.publish_time
            publish_ns = stamp.seconds * 1_000_000_000 + stamp.nanos
            if group and (
                sequence != group[-1][0] + 1
                or topic != group[-1][1]
                or publish_ns != group[-1][2]
                or len(group) >= _MIGRATED_BATCH
            ):
                flush()
            group.append((sequence, topic, publish_ns, message, references))
        after = rows[-1][0]
    flush()
    connection.execute("DROP TABLE messages")
    connection.execute("DROP TABLE counts")


def keep_counter_above(connection: sqlite3.Connection, highest_query: str, *parameters: Any) -> None:
    """Make the stored next sequence exceed what ``highest_query`` returns, before messages are deleted.

    Message IDs must never be reused, and after a restart the next sequence is the larger of this
    counter and the highest stored message + 1.
    """
    connection.execute(
        "INSERT INTO counters (name, value) VALUES ('next_sequence', "
        f"COALESCE(({highest_query}), 0) + 1) "
        "ON CONFLICT (name) DO UPDATE SET value = MAX(value, excluded.value)",
        parameters,
    )


def drop_holder(connection: sqlite3.Connection, identifier: int) -> None:
    """Delete a holder's references and spans, its id, and the batches only it kept (by trigger, in C)."""
    keep_counter_above(connection, HIGHEST)
    drop_spans(connection, identifier)
    connection.execute("DELETE FROM refs WHERE subscription = ?", (identifier,))
    connection.execute("DELETE FROM leases WHERE subscription = ?", (identifier,))
    connection.execute("DELETE FROM subscription_ids WHERE id = ?", (identifier,))


def unreference(connection: sqlite3.Connection, rows: list[tuple[int, int]]) -> None:
    """Drop the references (holder id, sequence) in ``rows``; a batch left with none goes (by trigger).
    A reference that does not exist changes nothing, so acknowledging twice is harmless.

    A span all of whose messages are in ``rows`` goes as one row; one partly in them becomes a row per
    message first (:func:`split_spans`), of which those in ``rows`` are then deleted.
    """
    if not rows:
        return
    keep_counter_above(connection, HIGHEST)
    by_holder: dict[int, set[int]] = {}
    for identifier, sequence in rows:
        by_holder.setdefault(identifier, set()).add(sequence)
    remaining: list[tuple[int, int]] = []
    for identifier, sequences in by_holder.items():
        acked = sorted(sequences)
        whole, partial = covering_spans(connection, identifier, acked)
        split_spans(connection, identifier, partial)
        if whole:
            drop_spans(connection, identifier, [first for first, _ in whole])
            gone = iter(whole)
            span = next(gone, None)
            for sequence in acked:
                while span is not None and span[1] < sequence:
                    span = next(gone, None)
                if span is None or sequence < span[0]:
                    remaining.append((identifier, sequence))
        else:
            remaining.extend((identifier, sequence) for sequence in acked)
    connection.executemany("DELETE FROM refs WHERE subscription = ? AND sequence = ?", remaining)


def covering_spans(
    connection: sqlite3.Connection, identifier: int, sequences: list[int]
) -> tuple[list[tuple[int, int]], list[int]]:
    """Holder ``identifier``'s spans over the sorted ``sequences``: those all of whose messages are in
    them, as (first, last), and the first sequences of those only some of whose messages are."""
    whole: list[tuple[int, int]] = []
    partial: list[int] = []
    if not sequences:
        return whole, partial
    low = holding_first(connection, sequences[0])
    for first, last in connection.execute(SPANS, (identifier, low, sequences[-1])).fetchall():
        count = bisect.bisect_right(sequences, last) - bisect.bisect_left(sequences, first)
        if count == last - first + 1:
            whole.append((first, last))
        elif count:
            partial.append(first)
    return whole, partial


def holding_first(connection: sqlite3.Connection, sequence: int) -> int:
    """The first sequence of the stored batch that holds ``sequence`` (or of the one below it), else
    ``sequence`` itself: where a holder's spans that may cover ``sequence`` start."""
    (first,) = connection.execute(f"SELECT COALESCE({_holding('?1')}, ?1)", (sequence,)).fetchone()
    return int(first)


def split_spans(connection: sqlite3.Connection, identifier: int, firsts: list[int]) -> None:
    """Holder ``identifier``'s spans over the batches starting at ``firsts`` become a reference row per
    message (generated inside SQLite from ``offsets``): what must come before a row is deleted or given
    attempts. The batches' counts do not change (the same references, held another way)."""
    rows = [(identifier, first) for first in firsts]
    connection.executemany(
        "INSERT INTO refs (subscription, sequence) SELECT s.subscription, b.first + o.n FROM spans s "
        "JOIN batches b ON b.first = s.first JOIN offsets o ON o.n <= b.last - b.first "
        "WHERE s.subscription = ?1 AND s.first = ?2",
        rows,
    )
    connection.executemany("DELETE FROM spans WHERE subscription = ? AND first = ?", rows)


def drop_spans(connection: sqlite3.Connection, identifier: int, firsts: list[int] | None = None) -> None:
    """Drop holder ``identifier``'s spans (those over the batches starting at ``firsts``, or all): each
    batch's count goes down by its length, and a batch left with none goes (by trigger). The caller
    keeps the sequence counter above the batches first (:func:`keep_counter_above`)."""
    if firsts is None:
        connection.execute(
            "UPDATE batches SET refs = refs - (last - first + 1) "
            "WHERE first IN (SELECT first FROM spans WHERE subscription = ?)",
            (identifier,),
        )
        connection.execute("DELETE FROM spans WHERE subscription = ?", (identifier,))
        return
    rows = [(identifier, first) for first in firsts]
    connection.executemany(
        "UPDATE batches SET refs = refs - (last - first + 1) "
        "WHERE first = ?2 AND EXISTS (SELECT 1 FROM spans WHERE subscription = ?1 AND first = ?2)",
        rows,
    )
    connection.executemany("DELETE FROM spans WHERE subscription = ? AND first = ?", rows)


def split_all_spans(connection: sqlite3.Connection, identifier: int) -> None:
    """Every span of holder ``identifier`` becomes reference rows (see :func:`split_spans`)."""
    connection.execute(
        "INSERT INTO refs (subscription, sequence) SELECT s.subscription, b.first + o.n FROM spans s "
        "JOIN batches b ON b.first = s.first JOIN offsets o ON o.n <= b.last - b.first "
        "WHERE s.subscription = ?1",
        (identifier,),
    )
    connection.execute("DELETE FROM spans WHERE subscription = ?", (identifier,))
