"""Drop the duplicates that hedging (and retries) can store, on the consumer side.

A hedged or retried batch can be stored twice, and each copy gets its own message ID, so a consumer cannot
tell a copy from a new message by its ID. A publisher built with ``idempotency_attribute=True`` stamps
every message with a unique key in the attribute :data:`IDEMPOTENCY_ATTRIBUTE` (the same value on every
copy, because every attempt sends the same request); a :class:`Deduplicator` remembers the keys it has
seen and drops later copies::

    from hedgepub.dedup import Deduplicator

    dedup = Deduplicator(max_ids=100_000)
    subscriber.subscribe(subscription, dedup.wrap(callback))  # the official SubscriberClient
    ...
    if not dedup.seen(message):                                # or by hand, for any message
        handle(message)

A redelivery of the *same* message (same message ID, after a nack or an expired ack deadline) is not a
duplicate and is passed on, so that a message whose first delivery failed is not lost. Only a copy with
another message ID is dropped. The window is bounded: at most ``max_ids`` keys (each kept as a 16-byte
digest with the first copy's message ID and arrival time, about 300 bytes per key in CPython), and with
``max_age`` none older than that many seconds; a copy that arrives after its key was forgotten is passed.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hedgepub._clock import DEFAULT_CLOCK, Clock

__all__ = ["IDEMPOTENCY_ATTRIBUTE", "DedupStats", "Deduplicator"]

#: The attribute a publisher built with ``idempotency_attribute=True`` stamps on every message.
IDEMPOTENCY_ATTRIBUTE = "hedgepub-idempotency-key"

#: Keys a :class:`Deduplicator` remembers unless told otherwise.
DEFAULT_MAX_IDS = 100_000


@dataclass(frozen=True)
class DedupStats:
    """What a :class:`Deduplicator` has seen (a snapshot).

    Attributes:
        checked: messages looked at.
        passed: messages let through: first copies, redeliveries and messages without a key.
        duplicates: copies dropped (a key seen before, with another message ID).
        redeliveries: messages passed although their key was known, because their message ID is the
            first copy's (a redelivery, not a copy).
        unkeyed: messages without the idempotency attribute (passed: they cannot be told apart).
        forgotten: keys dropped from the window (``max_ids`` or ``max_age``).
        tracked: keys in the window now.
    """

    checked: int = 0
    passed: int = 0
    duplicates: int = 0
    redeliveries: int = 0
    unkeyed: int = 0
    forgotten: int = 0
    tracked: int = 0


def _parts(message: Any) -> tuple[Mapping[str, str] | None, str]:
    """The attributes and message ID of an official subscriber ``Message``, a ``PubsubMessage``
    (raw or proto-plus), a ``ReceivedMessage`` or anything else with ``attributes`` and ``message_id``."""
    attributes = getattr(message, "attributes", None)
    if attributes is None and hasattr(message, "message"):  # a ReceivedMessage wraps the PubsubMessage
        return _parts(message.message)
    return attributes, str(getattr(message, "message_id", "") or "")


class Deduplicator:
    """Remembers idempotency keys and tells copies apart from first deliveries; thread-safe.

    Args:
        attribute: the attribute holding the key (the publisher's ``idempotency_attribute``).
        max_ids: most keys remembered at once; the oldest is forgotten first.
        max_age: seconds a key is remembered, or ``None`` for no limit but ``max_ids``.
        clock: where time is read (tests pass a virtual one).
    """

    def __init__(
        self,
        attribute: str = IDEMPOTENCY_ATTRIBUTE,
        *,
        max_ids: int = DEFAULT_MAX_IDS,
        max_age: float | None = None,
        clock: Clock = DEFAULT_CLOCK,
    ) -> None:
        if not isinstance(attribute, str) or not attribute:
            raise TypeError(f"attribute must be a non-empty str; got {attribute!r}")
        if isinstance(max_ids, bool) or not isinstance(max_ids, int) or max_ids < 1:
            raise ValueError(f"max_ids must be a whole number >= 1; got {max_ids!r}")
        if max_age is not None and (
            isinstance(max_age, bool) or not isinstance(max_age, (int, float)) or not max_age > 0
        ):
            raise ValueError(f"max_age must be seconds > 0 or None; got {max_age!r}")
        self._attribute = attribute
        self._max_ids = max_ids
        self._max_age = None if max_age is None else float(max_age)
        self._clock = clock
        self._lock = threading.Lock()
        # digest of the key -> (message ID of the first copy, when it arrived); oldest first
        self._window: OrderedDict[bytes, tuple[str, float]] = OrderedDict()
        self._checked = self._passed = self._duplicates = 0
        self._redeliveries = self._unkeyed = self._forgotten = 0

    @property
    def attribute(self) -> str:
        """The attribute that holds the idempotency key."""
        return self._attribute

    def seen(self, message: Any) -> bool:
        """Whether ``message`` is a copy of one already seen (drop it); remembers it otherwise.

        A message without the attribute, or the redelivery of the first copy (same message ID), is not
        a copy.
        """
        attributes, message_id = _parts(message)
        key = attributes.get(self._attribute) if attributes is not None else None
        if not key:
            with self._lock:
                self._checked += 1
                self._passed += 1
                self._unkeyed += 1
            return False
        # A fixed-size digest keeps memory per key bounded whatever the key's length.
        digest = hashlib.blake2b(key.encode("utf-8"), digest_size=16).digest()
        now = self._clock.now()
        with self._lock:
            self._checked += 1
            self._forget_old(now)
            first = self._window.get(digest)
            if first is None:
                self._window[digest] = (message_id, now)
                if len(self._window) > self._max_ids:
                    self._window.popitem(last=False)
                    self._forgotten += 1
                self._passed += 1
                return False
            if message_id and first[0] == message_id:
                self._redeliveries += 1
                self._passed += 1
                return False
            self._duplicates += 1
            return True

    def _forget_old(self, now: float) -> None:
        if self._max_age is None:
            return
        window = self._window
        while window:
            _, (_, arrived) = next(iter(window.items()))
            if now - arrived <= self._max_age:
                break
            window.popitem(last=False)
            self._forgotten += 1

    def wrap(self, callback: Callable[[Any], object]) -> Callable[[Any], None]:
        """A subscriber callback that acknowledges copies without calling ``callback``.

        For ``google.cloud.pubsub_v1.SubscriberClient.subscribe(subscription, dedup.wrap(callback))``:
        first copies and redeliveries go to ``callback`` (which acks or nacks them as before); a copy
        is acknowledged, so that it is not delivered again, and dropped.
        """

        def deduplicated(message: Any) -> None:
            if self.seen(message):
                message.ack()
                return
            callback(message)

        deduplicated.__doc__ = f"{getattr(callback, '__name__', 'callback')} without duplicates"
        return deduplicated

    def stats(self) -> DedupStats:
        """A snapshot of the counters."""
        with self._lock:
            return DedupStats(
                checked=self._checked,
                passed=self._passed,
                duplicates=self._duplicates,
                redeliveries=self._redeliveries,
                unkeyed=self._unkeyed,
                forgotten=self._forgotten,
                tracked=len(self._window),
            )

    def clear(self) -> None:
        """Forget every key (the counters are kept)."""
        with self._lock:
            self._window.clear()

    def __len__(self) -> int:
        return len(self._window)

    def __repr__(self) -> str:
        return (
            f"Deduplicator(attribute={self._attribute!r}, max_ids={self._max_ids}, "
            f"max_age={self._max_age}, tracked={len(self._window)})"
        )
