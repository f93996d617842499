"""A batch: messages for one topic (and ordering key) that travel in one Publish request.

Messages go straight into the raw ``PublishRequest`` as they are published, so the request that is sent
is built once, with no copy and no proto-plus. Sizes are those of the wire: a request is its ``topic``
field plus, per message, the field tag, the length prefix and the message's own ``ByteSize()``.
"""

from __future__ import annotations

import enum
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from hedgepub._publisher.futures import BatchCondition
from hedgepub._transport.grpc import PublishRequestPb


def varint_size(value: int) -> int:
    """Bytes of ``value`` encoded as a protobuf varint."""
    size = 1
    while value >= 0x80:
        value >>= 7
        size += 1
    return size


def field_size(payload_bytes: int) -> int:
    """Bytes of a length-delimited field (tag below 16) carrying ``payload_bytes`` bytes."""
    return 1 + varint_size(payload_bytes) + payload_bytes


def request_overhead(topic: str) -> int:
    """Bytes of a ``PublishRequest`` holding ``topic`` and no messages."""
    return field_size(len(topic.encode("utf-8")))


class BatchState(enum.Enum):
    """Where a batch is in its life."""

    #: Taking messages; a timer will seal it after ``max_latency``.
    OPEN = "open"
    #: Full or timed out: no more messages; waiting to be sent (behind its ordering key's previous batch).
    SEALED = "sealed"
    #: Handed to the sender, waiting for the previous batch of its ordering key to finish.
    QUEUED = "queued"
    #: Its Publish attempts are running through the hedging engine.
    SENDING = "sending"
    #: Every future has its result or error.
    DONE = "done"


def _describer(batch: weakref.ref[Batch], now: Callable[[], float]) -> Callable[[], str]:
    """What a batch (held weakly: the condition must not keep it alive) is doing now, in words."""

    def describe() -> str:
        held = batch()
        return "batch is gone" if held is None else held.describe(now())

    return describe


_STATE_TEXT = {
    "open": "waiting in its open batch for more messages (BatchSettings.max_latency)",
    "sealed": "sealed, waiting to be sent",
    "queued": "queued behind other batches in flight (or its ordering key's previous batch)",
    "done": "resolved",
}


class Batch:
    """Messages of one topic and ordering key, their futures, and the request that carries them."""

    __slots__ = (
        "__weakref__",
        "add_message",
        "append_message",
        "batch_id",
        "byte_size",
        "condition",
        "flow_bytes",
        "futures",
        "lock",
        "open_key",
        "ordering_key",
        "progress",
        "request",
        "state",
        "timer",
        "topic",
    )

    def __init__(
        self,
        topic: str,
        ordering_key: str,
        batch_id: str,
        sync_futures: bool,
        open_key: tuple[Any, ...] = (),
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.topic = topic
        self.ordering_key = ordering_key
        self.batch_id = batch_id
        self.request: Any = PublishRequestPb(topic=topic)
        # Bound once: these run once per message on the hot path.
        self.add_message = self.request.messages.add
        self.append_message = self.request.messages.append
        self.byte_size = request_overhead(topic)
        self.futures: list[Any] = []
        #: Shared by the batch's futures (see hedgepub._publisher.futures) when they are concurrent futures.
        self.condition: BatchCondition | None = (
            BatchCondition(_describer(weakref.ref(self), now)) if sync_futures else None
        )
        #: Bytes held against flow control (released when the batch resolves).
        self.flow_bytes = 0
        self.state = BatchState.OPEN
        self.timer: Any = None
        #: Guards messages going in against the batch being sealed (see the publisher's core): held by the
        #: thread adding a message, and by whoever seals the batch.
        self.lock = threading.Lock()
        #: The batch's key among the publisher's open batches.
        self.open_key = open_key
        #: Its attempts so far, once it is being sent (a hedgepub._publisher.sender.AttemptCounts).
        self.progress: Any = None

    @property
    def message_count(self) -> int:
        """Messages in the batch."""
        return len(self.futures)

    def describe_contents(self) -> str:
        """``batch of 3 messages to projects/p/topics/t (ordering key 'k')``."""
        count = len(self.futures)
        key = f" (ordering key {self.ordering_key!r})" if self.ordering_key else ""
        return f"batch of {count} message{'s' if count != 1 else ''} to {self.topic}{key}"

    def describe(self, now: float) -> str:
        """What the batch holds and where it is: queued, or being sent with its attempts and last error."""
        if self.state is BatchState.SENDING and self.progress is not None:
            where = f"being sent: {self.progress.describe(now)}"
        else:
            where = _STATE_TEXT.get(self.state.value, self.state.value)
        return f"{self.describe_contents()}, {where}"

    def __repr__(self) -> str:
        key = f", ordering_key={self.ordering_key!r}" if self.ordering_key else ""
        return (
            f"Batch({self.batch_id}, topic={self.topic!r}{key}, state={self.state.value}, "
            f"messages={len(self.futures)}, bytes={self.byte_size})"
        )
