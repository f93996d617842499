"""One message on its way in: checked, stamped, sized, and turned into a raw ``PubsubMessage`` if needed.

:class:`MessagePreparer` does what ``publish`` does before a message may enter a batch (and before flow
control could make the caller wait): type and size checks, the idempotency key, and the sizes the batch
counts with. It runs on the publishing thread, with no lock: its only shared state is a per-topic cache and
a counter, both safe to use from many threads at once in CPython.
"""

from __future__ import annotations

import itertools
import uuid
from typing import Any

from hedgepub._publisher.batch import field_size, request_overhead, varint_size
from hedgepub._settings import MAX_REQUEST_BYTES
from hedgepub._transport.grpc import PubsubMessagePb


class MessagePreparer:
    """Checks and sizes the messages of one publisher.

    Args:
        ordering: whether message ordering is on (an ordering key is refused otherwise).
        idempotency_attribute: the attribute to stamp a unique key in, or ``None`` for none.
    """

    def __init__(self, *, ordering: bool, idempotency_attribute: str | None) -> None:
        self.ordering = ordering
        self.idempotency_attribute = idempotency_attribute
        # 128 random bits per publisher, then a count: unique across publishers and processes.
        self._key_prefix = uuid.uuid4().hex
        self._message_keys = itertools.count()
        self._overheads: dict[str, int] = {}

    def prepare(
        self, topic: str, data: bytes, ordering_key: str, attributes: dict[str, Any]
    ) -> tuple[Any, int, int]:
        """Validate one message; return (raw message or None, message bytes, framed bytes)."""
        if not isinstance(data, bytes):
            raise TypeError(f"data must be bytes; got {type(data).__name__}")
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str; got {type(topic).__name__}")
        if ordering_key:
            if not isinstance(ordering_key, str):
                raise TypeError(f"ordering_key must be a str; got {type(ordering_key).__name__}")
            if not self.ordering:
                raise ValueError(
                    "ordering_key given but message ordering is not enabled: construct the publisher "
                    "with enable_message_ordering=True"
                )
        stamp = self.idempotency_attribute
        if stamp is not None and stamp not in attributes:
            # Stamped once, into the request every attempt sends: hedges and retries carry the same key.
            # A key the caller set is kept, so an application that republishes keeps its key too.
            attributes[stamp] = f"{self._key_prefix}-{next(self._message_keys)}"
        if attributes or ordering_key:
            message = PubsubMessagePb(
                data=data, attributes=check_attributes(attributes), ordering_key=ordering_key
            )
            size = message.ByteSize()
        else:
            message = None
            length = len(data)
            size = (2 + length if length < 0x80 else 1 + varint_size(length) + length) if length else 0
        framed = 2 + size if size < 0x80 else field_size(size)
        overhead = self._overheads.get(topic)
        if overhead is None:
            overhead = self._overheads.setdefault(topic, request_overhead(topic))
        if overhead + framed > MAX_REQUEST_BYTES:
            raise ValueError(
                f"the message is {size} bytes; with its topic it cannot fit a Publish request of at most "
                f"{MAX_REQUEST_BYTES} bytes"
            )
        return message, size, framed


def check_attributes(attributes: dict[str, Any]) -> dict[str, Any]:
    """Attribute values must be text; UTF-8 ``bytes`` are decoded, as the official client does."""
    for name, value in attributes.items():
        if type(value) is str:
            continue
        if isinstance(value, str):
            continue
        if isinstance(value, (bytes, bytearray)):
            try:
                attributes[name] = bytes(value).decode("utf-8")
                continue
            except UnicodeDecodeError:
                pass
        if name in ("retry", "timeout"):
            raise TypeError(
                f"publish(..., {name}=...) per message is the official client's argument; hedgepub sets it "
                "for the whole client: pass retry_settings=hedgepub.RetrySettings(...) (or "
                "publisher_options=...) to PublisherClient instead"
            )
        raise TypeError(
            f"attribute {name!r} must be a str (text); got {type(value).__name__}. "
            "All attributes published to Pub/Sub must be text strings."
        )
    return attributes
