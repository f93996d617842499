"""The SQLite store's file: a Publish is one row, and files of every earlier layout open and deliver.

The earlier layouts are written here with their own SQL (as those versions of hedgepub wrote them), not
through the store, so that the tests keep describing those files however the store changes.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import grpc

from hedgepub.server import LocalServer
from hedgepub.server._store.batch import Batch
from hedgepub.server._store.datadir import database_path
from hedgepub.server._store.sqlite import SqliteStore

from ..._pb import AcknowledgeRequest, PubsubMessage, PullRequest, PullResponse, Subscription, Topic

TOPIC = "projects/p/topics/stored"
OTHER = "projects/p/topics/other"
SUBSCRIPTIONS = ["projects/p/subscriptions/first", "projects/p/subscriptions/second"]
#: A recent whole second (older messages would be past the subscriptions' retention), in ns.
BASE = (time.time_ns() // 10**9 - 600) * 10**9

#: The per-message layout (the last before batches): a ``messages`` row per message, its body the
#: stamped ``PubsubMessage``; ``counts`` for messages with more than one reference.
_PER_MESSAGE_LAYOUT = """
CREATE TABLE topics (name TEXT PRIMARY KEY, body BLOB NOT NULL);
CREATE TABLE subscriptions (name TEXT PRIMARY KEY, body BLOB NOT NULL);
CREATE TABLE policies (name TEXT PRIMARY KEY, body BLOB NOT NULL);
CREATE TABLE schemas (name TEXT PRIMARY KEY, body BLOB NOT NULL);
CREATE TABLE snapshots (name TEXT PRIMARY KEY, body BLOB NOT NULL);
CREATE TABLE messages (sequence INTEGER PRIMARY KEY, topic TEXT NOT NULL, body BLOB NOT NULL);
CREATE TABLE counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE subscription_ids (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE);
CREATE TABLE refs (
    subscription INTEGER NOT NULL,
    sequence INTEGER NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (subscription, sequence)
) WITHOUT ROWID;
CREATE TABLE counts (sequence INTEGER PRIMARY KEY, refs INTEGER NOT NULL);
CREATE TABLE activity (subscription TEXT PRIMARY KEY, active_ns INTEGER NOT NULL);
CREATE TABLE leases (
    subscription INTEGER NOT NULL,
    sequence INTEGER NOT NULL,
    ack_id TEXT NOT NULL,
    deadline_ns INTEGER NOT NULL,
    PRIMARY KEY (subscription, sequence)
) WITHOUT ROWID;
"""
#: The first layout: a ``pending`` row per (subscription name, sequence), and no message ever deleted.
_PENDING_LAYOUT = """
CREATE TABLE topics (name TEXT PRIMARY KEY, body BLOB NOT NULL);
CREATE TABLE subscriptions (name TEXT PRIMARY KEY, body BLOB NOT NULL);
CREATE TABLE policies (name TEXT PRIMARY KEY, body BLOB NOT NULL);
CREATE TABLE messages (sequence INTEGER PRIMARY KEY, topic TEXT NOT NULL, body BLOB NOT NULL);
CREATE INDEX messages_by_topic ON messages (topic, sequence);
CREATE TABLE counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE pending (subscription TEXT NOT NULL, sequence INTEGER NOT NULL,
    PRIMARY KEY (subscription, sequence)) WITHOUT ROWID;
"""


#: The layout before spans (batches, bodies, a reference row per message and subscription), as it wrote a
#: Publish: through the view ``appends``, whose trigger generated the references from ``offsets``.
_BEFORE_SPANS_LAYOUT = """
CREATE TABLE topics (name TEXT PRIMARY KEY, body BLOB NOT NULL);
CREATE TABLE subscriptions (name TEXT PRIMARY KEY, body BLOB NOT NULL);
CREATE TABLE policies (name TEXT PRIMARY KEY, body BLOB NOT NULL);
CREATE TABLE schemas (name TEXT PRIMARY KEY, body BLOB NOT NULL);
CREATE TABLE snapshots (name TEXT PRIMARY KEY, body BLOB NOT NULL);
CREATE TABLE counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE subscription_ids (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE);
CREATE TABLE refs (
    subscription INTEGER NOT NULL,
    sequence INTEGER NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (subscription, sequence)
) WITHOUT ROWID;
CREATE TABLE activity (subscription TEXT PRIMARY KEY, active_ns INTEGER NOT NULL);
CREATE TABLE leases (
    subscription INTEGER NOT NULL,
    sequence INTEGER NOT NULL,
    ack_id TEXT NOT NULL,
    deadline_ns INTEGER NOT NULL,
    PRIMARY KEY (subscription, sequence)
) WITHOUT ROWID;
CREATE TABLE batches (
    first INTEGER PRIMARY KEY,
    last INTEGER NOT NULL,
    topic TEXT NOT NULL,
    publish_ns INTEGER NOT NULL,
    refs INTEGER NOT NULL
);
CREATE TABLE bodies (first INTEGER PRIMARY KEY, body BLOB NOT NULL);
CREATE TABLE offsets (n INTEGER PRIMARY KEY);
CREATE TRIGGER reference_dropped AFTER DELETE ON refs BEGIN
    UPDATE batches SET refs = refs - 1
    WHERE first = (SELECT first FROM batches WHERE first <= old.sequence ORDER BY first DESC LIMIT 1)
    AND last >= old.sequence;
END;
CREATE TRIGGER batch_unreferenced AFTER UPDATE OF refs ON batches WHEN new.refs <= 0 BEGIN
    DELETE FROM batches WHERE first = new.first;
END;
CREATE TRIGGER batch_deleted AFTER DELETE ON batches BEGIN
    DELETE FROM bodies WHERE first = old.first;
END;
CREATE VIEW appends (first, last, topic, publish_ns, refs, body, holder) AS
    SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL WHERE 0;
CREATE TRIGGER append_batch INSTEAD OF INSERT ON appends BEGIN
    INSERT INTO batches (first, last, topic, publish_ns, refs)
    VALUES (new.first, new.last, new.topic, new.publish_ns, new.refs);
    INSERT INTO bodies (first, body) VALUES (new.first, new.body);
    INSERT INTO refs (subscription, sequence) SELECT new.holder, new.first + n FROM offsets
    WHERE n <= new.last - new.first;
END;
"""


def stamped(sequence: int, data: bytes, publish_ns: int = 0, **attributes: str) -> bytes:
    """A message's body as the per-message layouts stored it: stamped with its ID and publish time."""
    message = PubsubMessage(data=data, message_id=str(sequence), attributes=attributes)
    message.publish_time.seconds, message.publish_time.nanos = divmod(publish_ns, 1_000_000_000)
    return bytes(message.SerializeToString())


def backlog(store: SqliteStore, subscription: str) -> list[tuple[int, bytes]]:
    return [(sequence, message.data) for sequence, message in store.pending(subscription, 0, 10_000)]


def write_per_message_file(path: Path) -> None:
    """A file of the per-message layout: on TOPIC, messages 1-3 published together (BASE + 10 s), 4 and
    5 at 20 s (5 acknowledged by both subscriptions, so gone), 7 at 30 s; 6 on OTHER at 20 s, kept
    without subscription. Both subscriptions reference 1, 2 and 4 (counted in ``counts``), the first
    alone 3 (with two delivery attempts recorded) and 7; 8 was published and acknowledged."""
    rows = [
        (1, TOPIC, stamped(1, b"one", BASE + 10 * 10**9, k="v")),
        (2, TOPIC, stamped(2, b"two", BASE + 10 * 10**9)),
        (3, TOPIC, stamped(3, b"three", BASE + 10 * 10**9)),
        (4, TOPIC, stamped(4, b"four", BASE + 20 * 10**9)),
        (6, OTHER, stamped(6, b"six", BASE + 20 * 10**9)),
        (7, TOPIC, stamped(7, b"seven", BASE + 30 * 10**9)),
    ]
    with sqlite3.connect(path) as old:
        old.executescript(_PER_MESSAGE_LAYOUT)
        old.execute("INSERT INTO topics VALUES (?, ?)", (TOPIC, Topic(name=TOPIC).SerializeToString()))
        for identifier, name in enumerate(SUBSCRIPTIONS, start=1):
            config = Subscription(name=name, topic=TOPIC, ack_deadline_seconds=600)
            old.execute("INSERT INTO subscriptions VALUES (?, ?)", (name, config.SerializeToString()))
            old.execute("INSERT INTO subscription_ids VALUES (?, ?)", (identifier, name))
        old.executemany("INSERT INTO messages VALUES (?, ?, ?)", rows)
        both = [(identifier, sequence) for identifier in (1, 2) for sequence in (1, 2, 4)]
        old.executemany("INSERT INTO refs (subscription, sequence) VALUES (?, ?)", [*both, (1, 3), (1, 7)])
        old.execute("INSERT INTO refs (subscription, sequence) VALUES (0, 6)")  # kept unsubscribed
        old.executemany("INSERT INTO counts VALUES (?, 2)", [(1,), (2,), (4,)])
        old.execute("UPDATE refs SET attempts = 2 WHERE subscription = 1 AND sequence = 3")
        old.execute("INSERT INTO counters VALUES ('next_sequence', 9)")


async def test_a_publish_is_one_row_and_goes_with_its_last_reference(tmp_path: Path) -> None:
    path = tmp_path / "batches.sqlite3"
    store = SqliteStore(path)
    try:
        for name in SUBSCRIPTIONS:
            await store.put("subscriptions", name, Subscription(name=name, topic=TOPIC))
        messages = [PubsubMessage(data=b"%d" % number) for number in range(100)]
        await store.append(Batch(1, TOPIC, BASE + 5 * 10**9, messages), SUBSCRIPTIONS)
        with sqlite3.connect(path) as file:
            rows = [
                file.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0] for table in ("batches", "bodies")
            ]
            assert rows == [1, 1]
            assert file.execute("SELECT refs FROM batches").fetchall() == [(200,)]
        page = store.pending(SUBSCRIPTIONS[1], 41, 2)
        assert [(sequence, message.data, message.message_id) for sequence, message in page] == [
            (42, b"41", "42"),
            (43, b"42", "43"),
        ]
        assert page[0][1].publish_time.seconds == BASE // 10**9 + 5
        await store.ack(SUBSCRIPTIONS[0], range(1, 101))
        await store.ack(SUBSCRIPTIONS[1], range(1, 100))
        assert [sequence for sequence, _ in store.messages(TOPIC)] == [100]
        assert store.first_sequence_at(0) == 100
        await store.ack(SUBSCRIPTIONS[1], [100, 100])  # twice: counted once
        with sqlite3.connect(path) as file:
            assert [
                file.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("batches", "bodies")
            ] == [0, 0]
        assert store.load().next_sequence == 101
    finally:
        await store.close()


async def test_a_batch_longer_than_any_publish_request_is_referenced_whole(tmp_path: Path) -> None:
    """Forwarded or migrated batches may exceed a Publish request's 1,000 messages."""
    store = SqliteStore(tmp_path / "long.sqlite3")
    try:
        await store.put("subscriptions", SUBSCRIPTIONS[0], Subscription(name=SUBSCRIPTIONS[0], topic=TOPIC))
        messages = [PubsubMessage(data=b"%d" % number) for number in range(2500)]
        await store.append(Batch(1, TOPIC, BASE, messages), SUBSCRIPTIONS[:1])
        assert store.referenced(SUBSCRIPTIONS[0]) == list(range(1, 2501))
        assert [(sequence, m.data) for sequence, m in store.pending(SUBSCRIPTIONS[0], 2498, 10)] == [
            (2499, b"2498"),
            (2500, b"2499"),
        ]
    finally:
        await store.close()


async def test_parsed_batches_are_shared_between_subscriptions_and_bounded(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "cache.sqlite3", cache_messages=150)
    try:
        for name in SUBSCRIPTIONS:
            await store.put("subscriptions", name, Subscription(name=name, topic=TOPIC))
        for first in (1, 101, 201):
            messages = [PubsubMessage(data=b"%d" % number) for number in range(first, first + 100)]
            await store.append(Batch(first, TOPIC, BASE, messages), SUBSCRIPTIONS)
        [(_, message)] = store.pending(SUBSCRIPTIONS[0], 0, 1)
        [(_, same)] = store.pending(SUBSCRIPTIONS[1], 0, 1)
        assert same is message  # one parsed copy serves both subscriptions
        assert len(store.pending(SUBSCRIPTIONS[0], 100, 200)) == 200  # batches 101 and 201: 1 is evicted
        [(_, again)] = store.pending(SUBSCRIPTIONS[1], 0, 1)
        assert again is not message and again == message
    finally:
        await store.close()


async def test_a_file_of_the_per_message_layout_is_migrated_once(tmp_path: Path) -> None:
    path = tmp_path / "per-message.sqlite3"
    write_per_message_file(path)
    store = SqliteStore(path, keep_unsubscribed=True)
    try:
        first, second = backlog(store, SUBSCRIPTIONS[0]), backlog(store, SUBSCRIPTIONS[1])
        assert first == [(1, b"one"), (2, b"two"), (3, b"three"), (4, b"four"), (7, b"seven")]
        assert second == [(1, b"one"), (2, b"two"), (4, b"four")]
        [(_, message)] = store.pending(SUBSCRIPTIONS[0], 0, 1)
        assert (message.message_id, message.publish_time.seconds, dict(message.attributes)) == (
            "1",
            BASE // 10**9 + 10,
            {"k": "v"},
        )
        assert store.attempts(SUBSCRIPTIONS[0], 0, 10) == {3: 2}
        assert [sequence for sequence, _ in store.messages(OTHER)] == [6]
        assert (
            store.first_sequence_at(BASE + 11 * 10**9) == 4
            and store.first_sequence_at(BASE + 21 * 10**9) == 7
        )
        assert store.load().next_sequence == 9
        with sqlite3.connect(path) as file:
            tables = {name for (name,) in file.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            assert not tables & {"messages", "counts"}
            # 1-3 were one Publish (one topic, one time, consecutive): one batch again.
            assert file.execute("SELECT first, last, refs FROM batches ORDER BY first").fetchall() == [
                (1, 3, 5),
                (4, 4, 2),
                (6, 6, 1),
                (7, 7, 1),
            ]
        await store.ack(SUBSCRIPTIONS[0], [1, 2, 3])
        await store.ack(SUBSCRIPTIONS[1], [1])
    finally:
        await store.close()
    store = SqliteStore(path, keep_unsubscribed=True)  # opened again: nothing left to migrate
    try:
        assert [sequence for sequence, _ in store.messages(TOPIC)] == [2, 4, 7]
        await store.ack(SUBSCRIPTIONS[1], [2, 4])
        await store.ack(SUBSCRIPTIONS[0], [4, 7])
        assert store.messages(TOPIC) == []
        await store.append(
            Batch(9, TOPIC, BASE + 40 * 10**9, [PubsubMessage(data=b"nine")]), SUBSCRIPTIONS[:1]
        )
        assert backlog(store, SUBSCRIPTIONS[0]) == [(9, b"nine")]
    finally:
        await store.close()


def _pull(channel: grpc.Channel, subscription: str) -> list[Any]:
    pull = channel.unary_unary(
        "/google.pubsub.v1.Subscriber/Pull",
        request_serializer=PullRequest.SerializeToString,
        response_deserializer=PullResponse.FromString,
    )
    request = PullRequest(subscription=subscription, max_messages=100, return_immediately=True)
    return list(pull(request, timeout=10).received_messages)


def _acknowledge(channel: grpc.Channel, subscription: str, ack_ids: list[str]) -> None:
    acknowledge = channel.unary_unary(
        "/google.pubsub.v1.Subscriber/Acknowledge", request_serializer=AcknowledgeRequest.SerializeToString
    )
    acknowledge(AcknowledgeRequest(subscription=subscription, ack_ids=ack_ids), timeout=10)


def test_a_server_on_a_per_message_data_directory_delivers_it_all(tmp_path: Path) -> None:
    write_per_message_file(database_path(tmp_path))
    with LocalServer(data_dir=tmp_path) as server, grpc.insecure_channel(server.address) as channel:
        received = {name: _pull(channel, name) for name in SUBSCRIPTIONS}
        assert [r.message.message_id for r in received[SUBSCRIPTIONS[0]]] == ["1", "2", "3", "4", "7"]
        assert [r.message.data for r in received[SUBSCRIPTIONS[1]]] == [b"one", b"two", b"four"]
        assert received[SUBSCRIPTIONS[0]][4].message.publish_time.seconds == BASE // 10**9 + 30
        assert received[SUBSCRIPTIONS[0]][2].delivery_attempt == 0  # no dead-letter policy: not shown
        for name in SUBSCRIPTIONS:  # all but the first message of each
            _acknowledge(channel, name, [r.ack_id for r in received[name][1:]])
    with LocalServer(data_dir=tmp_path) as server, grpc.insecure_channel(server.address) as channel:
        assert [r.message.data for r in _pull(channel, SUBSCRIPTIONS[0])] == [b"one"]
        assert [r.message.data for r in _pull(channel, SUBSCRIPTIONS[1])] == [b"one"]
        assert [m.message_id for m in server.messages(TOPIC)] == ["1"]


async def test_a_file_of_the_first_layout_opens(tmp_path: Path) -> None:
    """Before references, each subscription's backlog was a row per (name, sequence) and no message went."""
    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as old:
        old.executescript(_PENDING_LAYOUT)
        name = SUBSCRIPTIONS[0]
        old.execute(
            "INSERT INTO subscriptions VALUES (?, ?)", (name, Subscription(name=name).SerializeToString())
        )
        for sequence, data in ((1, b"acked"), (2, b"waiting"), (3, b"acked too")):
            old.execute("INSERT INTO messages VALUES (?, ?, ?)", (sequence, TOPIC, stamped(sequence, data)))
        old.execute("INSERT INTO pending VALUES (?, 2)", (name,))
    store = SqliteStore(path)
    try:
        assert backlog(store, SUBSCRIPTIONS[0]) == [(2, b"waiting")]
        assert [m.data for _, m in store.messages(TOPIC)] == [b"waiting"]
        assert store.load().next_sequence == 4
        await store.ack(SUBSCRIPTIONS[0], [2])
        assert store.messages(TOPIC) == []
    finally:
        await store.close()


async def test_a_file_that_found_references_through_an_index_opens(tmp_path: Path) -> None:
    """The layout before ``counts``: a message's references were found through an index on sequence."""
    path = tmp_path / "indexed.sqlite3"
    with sqlite3.connect(path) as old:
        old.executescript(_PER_MESSAGE_LAYOUT)
        old.execute("DROP TABLE counts")
        old.execute("CREATE INDEX refs_by_sequence ON refs (sequence)")
        old.executemany("INSERT INTO subscription_ids VALUES (?, ?)", enumerate(SUBSCRIPTIONS, start=1))
        old.executemany(
            "INSERT INTO subscriptions VALUES (?, ?)",
            [(name, Subscription(name=name, topic=TOPIC).SerializeToString()) for name in SUBSCRIPTIONS],
        )
        old.execute("INSERT INTO messages VALUES (1, ?, ?)", (TOPIC, stamped(1, b"both")))
        old.execute("INSERT INTO refs (subscription, sequence) SELECT id, 1 FROM subscription_ids")
    store = SqliteStore(path)
    try:
        await store.ack(SUBSCRIPTIONS[0], [1])
        assert [m.data for _, m in store.messages(TOPIC)] == [b"both"]  # the second still needs it
        await store.ack(SUBSCRIPTIONS[1], [1])
        assert store.messages(TOPIC) == []
    finally:
        await store.close()


async def test_a_file_without_delivery_attempts_opens(tmp_path: Path) -> None:
    """The layout before ``refs.attempts``: its references open as counting no attempt, and count on."""
    path = tmp_path / "uncounted.sqlite3"
    with sqlite3.connect(path) as old:
        old.executescript(_PER_MESSAGE_LAYOUT.replace("    attempts INTEGER NOT NULL DEFAULT 0,\n", ""))
        old.execute("INSERT INTO subscription_ids VALUES (1, ?)", (SUBSCRIPTIONS[0],))
        old.execute(
            "INSERT INTO subscriptions VALUES (?, ?)",
            (SUBSCRIPTIONS[0], Subscription(name=SUBSCRIPTIONS[0], topic=TOPIC).SerializeToString()),
        )
        old.executemany(
            "INSERT INTO messages VALUES (?, ?, ?)",
            [(1, TOPIC, stamped(1, b"one")), (2, TOPIC, stamped(2, b"two"))],
        )
        old.execute("INSERT INTO refs (subscription, sequence) VALUES (1, 1), (1, 2)")
    store = SqliteStore(path)
    try:
        assert [sequence for sequence, _ in backlog(store, SUBSCRIPTIONS[0])] == [1, 2]
        assert store.attempts(SUBSCRIPTIONS[0], 0, 2) == {}
        await store.record_attempts(SUBSCRIPTIONS[0], [(2, 3)])
        await store.append(Batch(3, TOPIC, 0, [PubsubMessage(data=b"three")]), SUBSCRIPTIONS[:1])
    finally:
        await store.close()
    store = SqliteStore(path)
    try:
        assert store.attempts(SUBSCRIPTIONS[0], 0, 3) == {2: 3}
        assert [sequence for sequence, _ in backlog(store, SUBSCRIPTIONS[0])] == [1, 2, 3]
    finally:
        await store.close()


async def test_a_publish_references_its_messages_by_one_span_per_subscription(tmp_path: Path) -> None:
    """A Publish writes no row per message: each subscription's references are one span, which becomes
    rows only where it must (a partial acknowledgement, a recorded attempt, a snapshot), goes as one row
    when acknowledged whole, and reads back the same after a restart."""
    path = tmp_path / "spans.sqlite3"
    store = SqliteStore(path)
    first, second = SUBSCRIPTIONS
    try:
        for name in SUBSCRIPTIONS:
            await store.put("subscriptions", name, Subscription(name=name, topic=TOPIC))
        for start in (1, 101, 201):
            messages = [PubsubMessage(data=b"%d" % number) for number in range(start, start + 100)]
            await store.append(Batch(start, TOPIC, BASE + start, messages), SUBSCRIPTIONS)

        def rows(table: str) -> int:
            with sqlite3.connect(path) as file:
                return int(file.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])

        assert (rows("spans"), rows("refs")) == (6, 0)
        assert store.referenced(first, 99, 103) == [99, 100, 101, 102]
        # The first acknowledges its first batch whole: one span goes, no row is made.
        await store.ack(first, range(1, 101))
        assert (rows("spans"), rows("refs")) == (5, 0)
        # The second acknowledges part of it: the rest of its span becomes rows.
        await store.ack(second, range(11, 21))
        assert (rows("spans"), rows("refs")) == (4, 90)
        assert [sequence for sequence, _ in store.pending(second, 9, 3)] == [10, 21, 22]
        # An attempt needs the message's own row; a new holder references spanned messages.
        await store.record_attempts(first, [(150, 2)])
        assert (rows("spans"), rows("refs")) == (3, 190)
        await store.reference("projects/p/snapshots/seeking", [150, 250, 999])
        assert store.referenced("projects/p/snapshots/seeking") == [150, 250]
        snapshot = Subscription(name="projects/p/snapshots/copy", topic=TOPIC)
        await store.put_snapshot("projects/p/snapshots/copy", snapshot, first)
        assert store.referenced("projects/p/snapshots/copy") == list(range(101, 301))
    finally:
        await store.close()
    store = SqliteStore(path)
    try:
        assert [sequence for sequence, _ in store.pending(first, 0, 1000)] == list(range(101, 301))
        expected = [*range(1, 11), *range(21, 301)]
        assert [sequence for sequence, _ in store.pending(second, 0, 1000)] == expected
        assert store.attempts(first, 0, 300) == {150: 2}
        assert store.first_sequence_at(BASE + 150) == 201
        # Every holder lets go of the last batch: it goes, with its body.
        for holder in ("projects/p/snapshots/seeking", "projects/p/snapshots/copy"):
            await store.release(holder)
        await store.ack(first, range(101, 301))
        await store.delete("subscriptions", second)
        assert store.messages(TOPIC) == []
        assert (rows("batches"), rows("bodies"), rows("spans"), rows("refs")) == (0, 0, 0, 0)
        assert store.load().next_sequence == 301
    finally:
        await store.close()


async def test_a_file_of_the_layout_before_spans_opens(tmp_path: Path) -> None:
    """The layout before spans (a reference row per message, generated by a trigger on append): its
    references read and acknowledge as before, and what is published from then on is spanned."""
    path = tmp_path / "rows.sqlite3"
    with sqlite3.connect(path) as old:
        old.executescript(_BEFORE_SPANS_LAYOUT)
        old.execute(
            "WITH RECURSIVE s(x) AS (SELECT 0 UNION ALL SELECT x + 1 FROM s WHERE x < 999) "
            "INSERT INTO offsets (n) SELECT x FROM s"
        )
        config = Subscription(name=SUBSCRIPTIONS[0], topic=TOPIC)
        old.execute("INSERT INTO subscriptions VALUES (?, ?)", (SUBSCRIPTIONS[0], config.SerializeToString()))
        old.execute("INSERT INTO subscription_ids VALUES (1, ?)", (SUBSCRIPTIONS[0],))
        body = Batch(1, TOPIC, BASE, [PubsubMessage(data=b"%d" % n) for n in (1, 2, 3)]).body()
        old.execute("INSERT INTO appends VALUES (1, 3, ?, ?, 3, ?, 1)", (TOPIC, BASE, body))
        old.execute("UPDATE refs SET attempts = 4 WHERE sequence = 3")
    store = SqliteStore(path)
    try:
        assert backlog(store, SUBSCRIPTIONS[0]) == [(1, b"1"), (2, b"2"), (3, b"3")]
        assert store.attempts(SUBSCRIPTIONS[0], 0, 3) == {3: 4}
        await store.append(Batch(4, TOPIC, BASE, [PubsubMessage(data=b"4")]), SUBSCRIPTIONS[:1])
        await store.ack(SUBSCRIPTIONS[0], [2])
    finally:
        await store.close()
    with sqlite3.connect(path) as file:
        assert file.execute("SELECT subscription, first FROM spans").fetchall() == [(1, 4)]
        assert file.execute("SELECT sequence FROM refs ORDER BY sequence").fetchall() == [(1,), (3,)]
    store = SqliteStore(path)
    try:
        assert backlog(store, SUBSCRIPTIONS[0]) == [(1, b"1"), (3, b"3"), (4, b"4")]
        await store.ack(SUBSCRIPTIONS[0], [1, 3, 4])
        assert store.messages(TOPIC) == []
    finally:
        await store.close()
