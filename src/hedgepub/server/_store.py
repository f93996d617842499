"""Storage behind the server: one small protocol, an in-memory implementation and (in ``_sqlite``) SQLite.

The core keeps the live delivery state (leases, ack IDs, ordering queues) in memory and writes through
to a store what must survive a restart: topics, subscriptions, IAM policies, every published message and,
per subscription, which messages are not yet acknowledged. Messages are numbered by a store-wide
sequence; a message's ID is its sequence number in decimal.

Stores take and return raw protobuf objects (``google.pubsub.v1`` and ``google.iam.v1``); a store may
keep references to the messages it is given, so callers never mutate a message after appending it.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from google.iam.v1 import policy_pb2
from google.pubsub_v1.types import pubsub as pubsub_types
from google.pubsub_v1.types import schema as schema_types

Topic: Any = pubsub_types.Topic.pb()
Subscription: Any = pubsub_types.Subscription.pb()
PubsubMessage: Any = pubsub_types.PubsubMessage.pb()
Policy: Any = policy_pb2.Policy
Schema: Any = schema_types.Schema.pb()

#: Which table a resource lives in (schemas: one record per revision, named ``{schema}@{revision_id}``).
ResourceKind = Literal["topics", "subscriptions", "policies", "schemas"]
_RESOURCE_CLASSES: dict[str, Any] = {
    "topics": Topic,
    "subscriptions": Subscription,
    "policies": Policy,
    "schemas": Schema,
}


def resource_class(kind: ResourceKind) -> Any:
    """The protobuf class stored under ``kind``."""
    return _RESOURCE_CLASSES[kind]


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
            publish_time=message.publish_time.ToDatetime(tzinfo=datetime.timezone.utc),
            topic=topic,
        )


@dataclass
class Snapshot:
    """Everything a store holds that the core needs back after a restart."""

    topics: dict[str, Any] = field(default_factory=dict)
    subscriptions: dict[str, Any] = field(default_factory=dict)
    policies: dict[str, Any] = field(default_factory=dict)
    #: ``{schema}@{revision_id}`` -> that revision (a ``Schema``).
    schemas: dict[str, Any] = field(default_factory=dict)
    #: subscription name -> its unacknowledged messages as (sequence, PubsubMessage), in sequence order.
    pending: dict[str, list[tuple[int, Any]]] = field(default_factory=dict)
    #: the sequence number the next published message gets.
    next_sequence: int = 1


class Store(Protocol):
    """What the core needs from storage. Every ``async`` method returns once the change is durable."""

    def load(self) -> Snapshot:
        """Read back everything stored (called once, before serving)."""

    async def put(self, kind: ResourceKind, name: str, body: Any) -> None:
        """Create or replace a topic, subscription, IAM policy or schema revision."""

    async def delete(self, kind: ResourceKind, name: str) -> None:
        """Delete a resource; deleting a subscription also forgets its unacknowledged messages."""

    async def append(
        self, topic: str, messages: Sequence[tuple[int, Any]], subscriptions: Sequence[str]
    ) -> None:
        """Store published messages (sequence, PubsubMessage) as unacknowledged on each subscription."""

    async def ack(self, subscription: str, sequences: Iterable[int]) -> None:
        """Forget acknowledged messages of a subscription (unknown sequences are ignored)."""

    def messages(self, topic: str) -> list[tuple[int, Any]]:
        """Every message stored on a topic, in publish order."""

    async def clear(self) -> None:
        """Delete everything."""

    async def close(self) -> None:
        """Finish pending writes and release resources."""


class MemoryStore:
    """A :class:`Store` in memory: nothing survives the process; every write is immediate."""

    def __init__(self) -> None:
        self._resources: dict[str, dict[str, Any]] = {kind: {} for kind in _RESOURCE_CLASSES}
        self._messages: dict[str, list[tuple[int, Any]]] = {}
        self._by_sequence: dict[int, Any] = {}
        self._pending: dict[str, dict[int, None]] = {}
        self._next_sequence = 1

    def load(self) -> Snapshot:
        """Return copies of everything held."""
        snapshot = Snapshot(next_sequence=self._next_sequence)
        for kind, target in (
            ("topics", snapshot.topics),
            ("subscriptions", snapshot.subscriptions),
            ("policies", snapshot.policies),
            ("schemas", snapshot.schemas),
        ):
            for name, body in self._resources[kind].items():
                target[name] = _copy(body)
        for subscription, sequences in self._pending.items():
            snapshot.pending[subscription] = [
                (sequence, self._by_sequence[sequence]) for sequence in sorted(sequences)
            ]
        return snapshot

    async def put(self, kind: ResourceKind, name: str, body: Any) -> None:
        """Keep a copy, so later changes by the caller do not leak in."""
        self._resources[kind][name] = _copy(body)
        if kind == "subscriptions":
            self._pending.setdefault(name, {})

    async def delete(self, kind: ResourceKind, name: str) -> None:
        """Drop the resource (and a subscription's backlog)."""
        self._resources[kind].pop(name, None)
        if kind == "subscriptions":
            self._pending.pop(name, None)

    async def append(
        self, topic: str, messages: Sequence[tuple[int, Any]], subscriptions: Sequence[str]
    ) -> None:
        """Append in memory; the hot path of the in-memory server, so kept minimal."""
        self._messages.setdefault(topic, []).extend(messages)
        by_sequence = self._by_sequence
        for sequence, message in messages:
            by_sequence[sequence] = message
        for subscription in subscriptions:
            pending = self._pending.setdefault(subscription, {})
            for sequence, _ in messages:
                pending[sequence] = None
        if messages:
            self._next_sequence = max(self._next_sequence, messages[-1][0] + 1)

    async def ack(self, subscription: str, sequences: Iterable[int]) -> None:
        """Forget acknowledged messages."""
        pending = self._pending.get(subscription)
        if pending is not None:
            for sequence in sequences:
                pending.pop(sequence, None)

    def messages(self, topic: str) -> list[tuple[int, Any]]:
        """Every message stored on ``topic``, in publish order."""
        return list(self._messages.get(topic, ()))

    async def clear(self) -> None:
        """Forget everything (the sequence keeps counting, so IDs stay unique)."""
        for table in self._resources.values():
            table.clear()
        self._messages.clear()
        self._by_sequence.clear()
        self._pending.clear()

    async def close(self) -> None:
        """Nothing to release."""

    def __repr__(self) -> str:
        counts = {kind: len(table) for kind, table in self._resources.items()}
        return f"MemoryStore({counts}, messages={len(self._by_sequence)})"


def _copy(body: Any) -> Any:
    duplicate = type(body)()
    duplicate.CopyFrom(body)
    return duplicate
