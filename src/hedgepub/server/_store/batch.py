"""A published batch: the messages of one Publish request, numbered together and stored as one unit.

Publishing numbers a request's messages with consecutive sequences and gives them one publish time, so
the batch, not the message, is what the stores keep: the in-memory store holds the request's messages as
they arrived, and the SQLite store writes one row per batch (the request serialized once, in C). A
message gets its ``message_id`` and ``publish_time`` only when it is read (:meth:`Batch.stamped`), which on
the ingest path is often never for most messages (a subscription's window holds a few hundred; the rest
are read from the store later, or acknowledged by a filter without being read).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from google.pubsub_v1.types import pubsub as pubsub_types

__all__ = ["Batch", "PublishRequest"]

PublishRequest: Any = pubsub_types.PublishRequest.pb()


class Batch:
    """Messages ``first`` .. ``first + len(messages) - 1`` of ``topic``, published at ``publish_ns``.

    ``request``, when given, is the ``PublishRequest`` whose ``messages`` these are (all of them, in order):
    :meth:`body` then serializes it as it is instead of copying every message into a new request.
    """

    __slots__ = ("_stamped", "first", "messages", "publish_ns", "request", "topic")

    def __init__(
        self,
        first: int,
        topic: str,
        publish_ns: int,
        messages: Sequence[Any],
        request: Any = None,
    ) -> None:
        self.first = first
        self.topic = topic
        self.publish_ns = publish_ns
        self.messages = messages
        self.request = request
        self._stamped = False

    def __len__(self) -> int:
        return len(self.messages)

    def __repr__(self) -> str:
        return f"Batch({self.topic!r}, {self.first}..{self.end - 1})"

    @property
    def end(self) -> int:
        """The sequence after the batch's last."""
        return self.first + len(self.messages)

    def ids(self) -> list[str]:
        """The message IDs, in order (a message's ID is its sequence in decimal)."""
        return list(map(str, range(self.first, self.end)))

    def stamped(self) -> Sequence[Any]:
        """The messages with their ``message_id`` and ``publish_time`` set (in place, the first time)."""
        messages = self.messages
        if not self._stamped:
            seconds, nanos = divmod(self.publish_ns, 1_000_000_000)
            sequence = self.first
            for message in messages:
                message.message_id = str(sequence)
                stamp = message.publish_time
                stamp.seconds = seconds
                stamp.nanos = nanos
                sequence += 1
            self._stamped = True
        return messages

    def message(self, sequence: int) -> Any:
        """The stamped message of ``sequence`` (which must be in the batch)."""
        return self.stamped()[sequence - self.first]

    def body(self) -> bytes:
        """The messages as one serialized ``PublishRequest`` (topic left empty unless ``request`` had it):
        what the SQLite store keeps; :meth:`from_body` reads it back."""
        if self.request is not None:
            return self.request.SerializeToString()
        return PublishRequest(messages=self.messages).SerializeToString()

    @classmethod
    def from_body(cls, first: int, topic: str, publish_ns: int, body: bytes) -> Batch:
        """The batch :meth:`body` wrote (its messages stamped on first read, as any batch's)."""
        request = PublishRequest.FromString(body)
        return cls(first, topic, publish_ns, request.messages, request)
