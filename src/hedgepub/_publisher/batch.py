"""A batch: messages for one topic (and ordering key) that travel in one Publish request.

A batch keeps its messages as the bytes they take in the request: a message of data alone is framed by
hand (a few bytes of field tags and lengths, kept per length, then the caller's bytes, not copied), any
other message is serialized once. The request that is sent is those pieces joined behind the topic field,
built once when the batch is sent: no protobuf object per message, no proto-plus. Messages of data alone
are kept as the caller's bytes only (:attr:`Batch.plain`, one list append on the hot path) and framed
when the request is built, all at once: when they have one length, as most batches' do, by joining them
with that length's head, at C speed. Adding a message costs about half of adding it to a protobuf request,
and the request needs no serializing: every transport takes those bytes (:meth:`Batch.wire`);
:attr:`Batch.request` is the same bytes parsed, for telemetry. Sizes are those of the wire: a request is
its ``topic`` field plus, per message, the field tag, the length prefix and the message's own
``ByteSize()``.
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


def varint(value: int) -> bytes:
    """``value`` encoded as a protobuf varint."""
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# Field tags (number << 3 | 2, length-delimited): PublishRequest.topic (1), PublishRequest.messages (2),
# PubsubMessage.data (1).
_TOPIC_TAG, _MESSAGES_TAG, _DATA_TAG = b"\x0a", b"\x12", b"\x0a"

#: What goes before a payload of each length below 16 KiB to make it a framed message of data alone (at
#: most 16,384 entries of 4 to 6 bytes: about 1.5 MiB with the dict, if every length is published).
DATA_HEADS: dict[int, bytes] = {}


def data_head(length: int) -> bytes:
    """The bytes before a ``length``-byte payload that make it a framed message of data alone in a
    ``PublishRequest`` (the ``messages`` field's tag and length, then the ``data`` field's; an empty
    payload is an empty message)."""
    head = DATA_HEADS.get(length)
    if head is None:
        body = _DATA_TAG + varint(length) if length else b""
        head = _MESSAGES_TAG + varint(len(body) + length) + body
        if length < 0x4000:
            DATA_HEADS[length] = head
    return head


def frame_data(payloads: list[bytes], before: bytes = b"") -> bytes:
    """``payloads`` framed as messages of data alone, in order, as they go into a ``PublishRequest``,
    behind ``before`` (in the same copy)."""
    if not payloads:
        return before
    lengths = set(map(len, payloads))
    if len(lengths) == 1:  # one head for all: joined with it, behind the first piece (one copy)
        return data_head(lengths.pop()).join([before, *payloads])
    heads = DATA_HEADS
    framed = [piece for data in payloads for piece in (heads.get(len(data)) or data_head(len(data)), data)]
    if before:
        framed.insert(0, before)
    return b"".join(framed)


def message_head(size: int) -> bytes:
    """The bytes before a serialized message of ``size`` bytes that frame it in a ``PublishRequest``."""
    return _MESSAGES_TAG + varint(size)


def topic_field(topic: str) -> bytes:
    """A ``PublishRequest``'s ``topic`` field."""
    encoded = topic.encode("utf-8")
    return _TOPIC_TAG + varint(len(encoded)) + encoded


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

    # A member is its own identity (Enum compares by it): hashed as an object, in C, rather than by
    # Enum's Python-level __hash__, on each of a batch's moves (Batch.move looks it up in TRANSITIONS).
    __hash__ = object.__hash__


class IllegalTransition(RuntimeError):
    """A batch was moved to a state its table (:data:`TRANSITIONS`) does not lead to: a bug in the
    publisher. Raised where a batch is dispatched, it fails that batch's futures with an internal error."""


#: Every state a batch may move to from each state (:meth:`Batch.move`); any other move raises
#: :class:`IllegalTransition`. A batch fails (``DONE``) from any state before its end: an internal error,
#: its ordering key paused, shutdown or a fork abandoning it.
TRANSITIONS: dict[BatchState, frozenset[BatchState]] = {
    BatchState.OPEN: frozenset({BatchState.SEALED, BatchState.DONE}),
    BatchState.SEALED: frozenset({BatchState.QUEUED, BatchState.SENDING, BatchState.DONE}),
    # Queued again: its key's previous batch finished while the most batches are in flight.
    BatchState.QUEUED: frozenset({BatchState.QUEUED, BatchState.SENDING, BatchState.DONE}),
    BatchState.SENDING: frozenset({BatchState.DONE}),
    BatchState.DONE: frozenset(),
}


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
        "_request",
        "_wire",
        "batch_id",
        "byte_size",
        "condition",
        "extra_metadata",
        "flow_bytes",
        "futures",
        "keepalive",
        "lock",
        "open_key",
        "ordering_key",
        "parts",
        "plain",
        "progress",
        "ready_count",
        "segments",
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
        #: The messages as they go on the wire, in order (see the module's docstring), before those of
        #: :attr:`plain`.
        self.parts: list[bytes] = []
        #: Payloads of messages of data alone added after :attr:`parts`, not framed yet.
        self.plain: list[bytes] = []
        self._wire: bytes | None = None
        self._request: Any = None
        self.byte_size = request_overhead(topic)
        self.futures: list[Any] = []
        #: Shared by the batch's futures (see hedgepub._publisher.futures) when they are concurrent futures.
        self.condition: BatchCondition | None = (
            BatchCondition(_describer(weakref.ref(self), now)) if sync_futures else None
        )
        #: Bytes held against flow control (released when the batch resolves).
        self.flow_bytes = 0
        #: Where the batch is in its life; changed by :meth:`move` only.
        self.state = BatchState.OPEN
        self.timer: Any = None
        #: Guards messages going in against the batch being sealed (see the publisher's core): held by the
        #: thread adding a message, and by whoever seals the batch.
        self.lock = threading.Lock()
        #: The batch's key among the publisher's open batches.
        self.open_key = open_key
        #: Its attempts so far, once it is being sent (a hedgepub._publisher.sender.AttemptCounts).
        self.progress: Any = None
        #: Runs of ``publish_many`` messages, as (their ManyResult, first index in :attr:`futures`, count,
        #: first index in the call); their entries in :attr:`futures` are ``futures.BULK``. None if none.
        self.segments: list[tuple[Any, int, int, int]] | None = None
        #: What keeps the client that made the batch alive until the batch resolves (a sync client's
        #: keep-alive token, see ``PublisherClient``), or ``None``.
        self.keepalive: object | None = None
        #: Metadata every attempt sends after the sender's own (routing, telemetry, batch id): a forwarded
        #: request's caller's, such as its ``authorization`` (see :meth:`ready_made`).
        self.extra_metadata: tuple[tuple[str, str], ...] = ()
        #: The messages of a ready-made batch (its request exists already; it has no futures), else None.
        self.ready_count: int | None = None

    @classmethod
    def ready_made(
        cls,
        topic: str,
        ordering_key: str,
        batch_id: str,
        wire: bytes,
        count: int,
        extra_metadata: tuple[tuple[str, str], ...] = (),
        now: Callable[[], float] = time.monotonic,
    ) -> Batch:
        """A sealed batch whose serialized ``PublishRequest`` exists already (``wire``, of ``count``
        messages to ``topic``; ``ordering_key`` is one of its messages' keys, or ``""`` if none has one),
        sent as it is, with ``extra_metadata`` after the sender's own metadata on every attempt.

        It has no futures: whoever sends it reads the outcome (``hedgepub proxy`` forwarding a caller's
        request, :meth:`hedgepub._publisher.core._PublisherCore.forward`).
        """
        batch = cls(topic, ordering_key, batch_id, sync_futures=False, now=now)
        batch._wire = wire
        batch.byte_size = len(wire)
        batch.move(BatchState.SEALED)
        batch.ready_count = count
        batch.extra_metadata = tuple(extra_metadata)
        return batch

    def move(self, to: BatchState) -> None:
        """Move to state ``to``: the one way :attr:`state` changes (it is read without a call on the hot
        path). Raises :class:`IllegalTransition` if :data:`TRANSITIONS` has no such move."""
        if to not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"{self!r} cannot move from {self.state.value} to {to.value}")
        self.state = to

    def add_data(self, data: bytes) -> None:
        """Add a message of ``data`` alone (holding the batch's lock)."""
        self.plain.append(data)

    def add_message(self, message: Any) -> None:
        """Add a raw ``PubsubMessage`` (holding the batch's lock)."""
        body = message.SerializeToString()
        if self.plain:  # the messages of data alone before it go first
            self.parts.append(frame_data(self.plain))
            self.plain = []
        self.parts += (message_head(len(body)), body)

    def wire(self) -> bytes:
        """The serialized ``PublishRequest``; built once the batch is sealed (it is kept from then on)."""
        wire = self._wire
        if wire is None:
            if self.parts:
                wire = b"".join([topic_field(self.topic), *self.parts, frame_data(self.plain)])
            else:  # messages of data alone (the usual batch): framed behind the topic in one copy
                wire = frame_data(self.plain, topic_field(self.topic))
            if self.state is not BatchState.OPEN:
                self._wire, self.parts, self.plain = wire, [], []
        return wire

    @property
    def request(self) -> Any:
        """The ``PublishRequest`` as a raw protobuf message, parsed from :meth:`wire` (once sealed, once)."""
        request = self._request
        if request is None:
            request = PublishRequestPb.FromString(self.wire())
            if self._wire is not None:
                self._request = request
        return request

    @property
    def message_count(self) -> int:
        """Messages in the batch."""
        count = self.ready_count
        return len(self.futures) if count is None else count

    def describe_contents(self) -> str:
        """``batch of 3 messages to projects/p/topics/t (ordering key 'k')``."""
        count = self.message_count
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
            f"messages={self.message_count}, bytes={self.byte_size})"
        )
