"""The seam between the server and its storage: the :class:`Store` protocol and what crosses it.

Two stores implement it: :class:`~hedgepub.server._store.memory.MemoryStore` (in memory) and
:class:`~hedgepub.server._store.sqlite.SqliteStore` (SQLite); each subclasses :class:`Store`, so the type
checker holds both to its signatures.

The core keeps the live delivery state (a bounded window of ready messages, leases, ack IDs, ordering
queues) in memory and writes through to a store what must survive a restart: topics, subscriptions, IAM
policies, every published message (once) and, per subscription, a reference to each message it has not
acknowledged yet (which, under a dead-letter policy, also counts the message's unacknowledged deliveries,
so that ``delivery_attempt`` goes on where it was after a restart). Messages are numbered by a store-wide
sequence; a message's ID is its sequence number in decimal. A message is deleted when the last reference
to it goes (acknowledged, dropped with a detached or deleted subscription), unless a retention rule keeps
it: today the only rule is ``keep_unsubscribed``, which keeps what is published while a topic has no
subscription so that ``LocalServer.messages`` can show it. (Retained acknowledged messages, topic
retention and snapshots are further rules of the same kind: a reference, or a timestamp, that keeps the
one stored copy alive; never a second copy.)

The core reads a subscription's backlog in pages (:meth:`Store.pending`), so nothing holds a whole
backlog in memory but the in-memory store itself.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from google.iam.v1 import policy_pb2
from google.pubsub_v1.types import pubsub as pubsub_types
from google.pubsub_v1.types import schema as schema_types

from hedgepub.server._store.batch import Batch

Topic: Any = pubsub_types.Topic.pb()
Subscription: Any = pubsub_types.Subscription.pb()
PubsubMessage: Any = pubsub_types.PubsubMessage.pb()
Policy: Any = policy_pb2.Policy
Schema: Any = schema_types.Schema.pb()
PubsubSnapshot: Any = pubsub_types.Snapshot.pb()

#: Which table a resource lives in (schemas: one record per revision, named ``{schema}@{revision_id}``).
ResourceKind = Literal["topics", "subscriptions", "policies", "schemas", "snapshots"]
RESOURCE_CLASSES: dict[str, Any] = {
    "topics": Topic,
    "subscriptions": Subscription,
    "policies": Policy,
    "schemas": Schema,
    "snapshots": PubsubSnapshot,
}
#: Kinds whose resources hold references to messages (a snapshot keeps what it may replay).
HOLDING_KINDS = frozenset({"subscriptions", "snapshots"})


def resource_class(kind: ResourceKind) -> Any:
    """The protobuf class stored under ``kind``."""
    return RESOURCE_CLASSES[kind]


@dataclass(frozen=True)
class StoredMessage:
    """A message as stored on a topic: what :meth:`LocalServer.messages` returns."""

    message_id: str
    data: bytes
    attributes: dict[str, str]
    ordering_key: str
    publish_time: datetime.datetime
    topic: str

    @classmethod
    def from_pb(cls, topic: str, message: Any) -> StoredMessage:
        """Build from a stored ``PubsubMessage`` protobuf."""
        return cls(
            message_id=message.message_id,
            data=bytes(message.data),
            attributes=dict(message.attributes),
            ordering_key=message.ordering_key,
            publish_time=message.publish_time.ToDatetime(tzinfo=datetime.UTC),
            topic=topic,
        )


@dataclass
class Snapshot:
    """What the core needs back after a restart before it serves: resources and the sequence counter.

    Backlogs are not in it: the core reads them lazily, a page at a time, with :meth:`Store.pending`.
    """

    topics: dict[str, Any] = field(default_factory=dict)
    subscriptions: dict[str, Any] = field(default_factory=dict)
    policies: dict[str, Any] = field(default_factory=dict)
    #: ``{schema}@{revision_id}`` -> that revision (a ``Schema``).
    schemas: dict[str, Any] = field(default_factory=dict)
    #: Pub/Sub snapshots (``google.pubsub.v1.Snapshot``) by name.
    snapshots: dict[str, Any] = field(default_factory=dict)
    #: the sequence number the next published message gets.
    next_sequence: int = 1
    #: subscription name -> when it was last recorded active (ns since the epoch), for expiration.
    activity: dict[str, int] = field(default_factory=dict)


class Store(Protocol):
    """What the core needs from storage. Every ``async`` method returns once the change is durable."""

    def load(self) -> Snapshot:
        """Read back the resources and the sequence counter (called once, before serving)."""

    async def put(self, kind: ResourceKind, name: str, body: Any) -> None:
        """Create or replace a topic, subscription, IAM policy or schema revision."""

    async def delete(self, kind: ResourceKind, name: str) -> None:
        """Delete a resource; deleting a subscription also drops its references (and what only they kept)."""

    async def append(self, batch: Batch, subscriptions: Sequence[str]) -> None:
        """Store a published batch once, each of its messages referenced by each subscription."""

    async def reserve(self, last: int) -> None:
        """Remember that sequences up to ``last`` were given out (as IDs of messages not stored), so that
        no later message, after a restart too, gets one of them."""

    async def ack(self, subscription: str, sequences: Iterable[int]) -> None:
        """Drop a subscription's references (unknown sequences are ignored); unreferenced messages go."""

    def pending(self, subscription: str, after: int, limit: int, max_bytes: int = 0) -> list[tuple[int, Any]]:
        """Up to ``limit`` messages ``subscription`` references with a sequence above ``after``, in order;
        with ``max_bytes``, no more once they hold that many bytes (one at least)."""

    def messages(self, topic: str) -> list[tuple[int, Any]]:
        """Every message still stored on a topic, in publish order."""

    # Replay (retention, snapshots, seek): a "holder" is a subscription, a snapshot, or a retention holder
    # the core names (a subscription's retained acknowledged messages, a topic's retained messages).
    async def register(self, holder: str) -> None:
        """Make ``holder`` able to hold references (idempotent; subscriptions and snapshots already are)."""

    async def release(self, holder: str) -> None:
        """Drop every reference ``holder`` has (and the messages only they kept); forget the holder."""

    async def reference(self, holder: str, sequences: Iterable[int]) -> None:
        """Add references from ``holder`` to stored messages (sequences no longer stored are skipped)."""

    async def put_snapshot(self, name: str, body: Any, source: str) -> None:
        """Create snapshot ``name`` holding what ``source`` references now, all at once: after a crash
        there is either no snapshot or the whole of it, never a snapshot without its messages."""

    def referenced(self, holder: str, low: int = 0, high: int | None = None) -> list[int]:
        """The sequences ``holder`` references in ``[low, high)``, in order."""

    def first_sequence_at(self, publish_ns: int) -> int | None:
        """The sequence of the first stored message published at or after ``publish_ns`` (ns since the
        epoch); ``None`` if there is none. Sequences follow publish times."""

    # Exactly-once delivery: leases that must outlive a restart.
    async def put_leases(self, subscription: str, leases: Sequence[tuple[int, str, int]]) -> None:
        """Record leases (sequence, ack ID, deadline in ns since the epoch), replacing earlier ones."""

    async def drop_leases(self, subscription: str, sequences: Iterable[int]) -> None:
        """Forget the leases of these sequences."""

    def leases(self, subscription: str) -> list[tuple[int, str, int]]:
        """The recorded leases of a subscription (sequence, ack ID, deadline ns), by sequence."""

    # Dead-letter policies: delivery attempts that must outlive a restart, kept on the references.
    async def record_attempts(self, subscription: str, attempts: Sequence[tuple[int, int]]) -> None:
        """Record, per message (sequence, count), how many of its deliveries ended unacknowledged (nack
        or deadline); a later count replaces an earlier one. Messages no longer referenced are skipped."""

    def attempts(self, subscription: str, after: int, through: int) -> dict[int, int]:
        """The counts recorded for the messages ``subscription`` references in ``(after, through]``
        (only those with a count)."""

    # Expiration: when each subscription was last active, as recorded (coarsely) by the core.
    async def put_activity(self, activity: Sequence[tuple[str, int]]) -> None:
        """Record when subscriptions were last active (name, ns since the epoch), replacing earlier
        records; names that are not subscriptions (any more) are skipped. Deleting a subscription
        forgets its record; :meth:`load` returns them."""

    async def clear(self) -> None:
        """Delete everything."""

    async def close(self) -> None:
        """Finish pending writes and release resources."""
