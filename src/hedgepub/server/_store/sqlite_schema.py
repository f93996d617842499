"""The file of the :class:`~hedgepub.server._store.sqlite.SqliteStore`: its tables, how a connection to
it is set up, how a file of an earlier layout is brought to this one, and the statements that keep each
message's references counted (run on the writer thread's connection).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

__all__ = [
    "KEEP",
    "REFERENCE",
    "SCHEMA",
    "TABLES",
    "connect",
    "drop_holder",
    "keep_counter_above",
    "migrate",
    "unreference",
]

SCHEMA = """
CREATE TABLE IF NOT EXISTS topics (name TEXT PRIMARY KEY, body BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS subscriptions (name TEXT PRIMARY KEY, body BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS policies (name TEXT PRIMARY KEY, body BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS schemas (name TEXT PRIMARY KEY, body BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS snapshots (name TEXT PRIMARY KEY, body BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS messages (sequence INTEGER PRIMARY KEY, topic TEXT NOT NULL, body BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS subscription_ids (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE);
CREATE TABLE IF NOT EXISTS refs (
    subscription INTEGER NOT NULL,
    sequence INTEGER NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (subscription, sequence)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS counts (sequence INTEGER PRIMARY KEY, refs INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS activity (subscription TEXT PRIMARY KEY, active_ns INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    subscription INTEGER NOT NULL,
    sequence INTEGER NOT NULL,
    ack_id TEXT NOT NULL,
    deadline_ns INTEGER NOT NULL,
    PRIMARY KEY (subscription, sequence)
) WITHOUT ROWID;
"""
# How an acknowledgement (subscription ?1, sequence ?2) drops a reference, in this order. A message with
# one reference has no ``counts`` row (the common case: one subscription, no extra b-tree to write at
# publish); one with more counts its live references there. Each statement acts only if the reference
# exists, so acknowledging twice, or a message the subscription never had, changes nothing.
_REFERENCED = "EXISTS (SELECT 1 FROM refs WHERE subscription = ?1 AND sequence = ?2)"
_UNREFERENCE = (
    # The last reference: the message goes.
    f"DELETE FROM messages WHERE sequence = ?2 AND {_REFERENCED} "
    "AND COALESCE((SELECT refs FROM counts WHERE sequence = ?2), 1) <= 1",
    f"UPDATE counts SET refs = refs - 1 WHERE sequence = ?2 AND {_REFERENCED}",
    "DELETE FROM refs WHERE subscription = ?1 AND sequence = ?2",
    "DELETE FROM counts WHERE sequence = ?2 AND refs <= 0",
)
# How a holder (?1) comes to reference a stored message (?2) it did not reference yet, in this order: the
# message's count starts from the one reference it has when it has no row, and goes up by one.
_NEW_REFERENCE = "EXISTS (SELECT 1 FROM messages WHERE sequence = ?2) AND NOT " + _REFERENCED
REFERENCE = (
    f"INSERT OR IGNORE INTO counts (sequence, refs) SELECT ?2, 1 WHERE {_NEW_REFERENCE}",
    f"UPDATE counts SET refs = refs + 1 WHERE sequence = ?2 AND {_NEW_REFERENCE}",
    "INSERT OR IGNORE INTO refs (subscription, sequence) "
    "SELECT ?1, ?2 WHERE EXISTS (SELECT 1 FROM messages WHERE sequence = ?2)",
)
TABLES = ("topics", "subscriptions", "policies", "schemas", "snapshots")
#: The reference that keeps a message published to a topic without subscriptions (``keep_unsubscribed``).
KEEP = 0


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
    return connection


def migrate(connection: sqlite3.Connection, *, keep_unsubscribed: bool) -> None:
    """Bring a file of an earlier layout to this one.

    The first layout kept a ``pending`` row per (subscription name, sequence) and every message for
    good; the next one found a message's references through an index on ``refs (sequence)`` instead
    of ``counts``; the one after that had no ``attempts`` column in ``refs`` (its messages start
    from no recorded attempt, as they did at every restart then). Tables added since (``activity``)
    need nothing here: the schema script creates them, empty.
    """
    columns = {row[1] for row in connection.execute("PRAGMA table_info(refs)")}
    if "attempts" not in columns:
        # A schema change only: existing rows read the default without being rewritten.
        connection.execute("ALTER TABLE refs ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0")
    tables = {name for (name,) in connection.execute("SELECT name FROM sqlite_master")}
    if "refs_by_sequence" in tables:
        connection.execute("BEGIN IMMEDIATE")
        connection.execute(
            "INSERT OR REPLACE INTO counts (sequence, refs) "
            "SELECT sequence, COUNT(*) FROM refs GROUP BY sequence HAVING COUNT(*) > 1"
        )
        connection.execute("DROP INDEX refs_by_sequence")
        connection.execute("COMMIT")
    if "pending" not in tables:
        return
    connection.execute("BEGIN IMMEDIATE")
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
    connection.execute("COMMIT")


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
    """Delete a holder's references, its id, and the messages only it kept."""
    rows = connection.execute(
        "SELECT subscription, sequence FROM refs WHERE subscription = ?", (identifier,)
    ).fetchall()
    unreference(connection, rows)
    connection.execute("DELETE FROM leases WHERE subscription = ?", (identifier,))
    connection.execute("DELETE FROM subscription_ids WHERE id = ?", (identifier,))


def unreference(connection: sqlite3.Connection, rows: list[tuple[int, int]]) -> None:
    """Drop the references (holder id, sequence) in ``rows``, and the messages left with none."""
    if not rows:
        return
    keep_counter_above(connection, "SELECT MAX(sequence) FROM messages")
    for statement in _UNREFERENCE:
        connection.executemany(statement, rows)
