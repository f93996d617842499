"""One message on its way in: checked, stamped, sized, and turned into a raw ``PubsubMessage`` if needed.

:class:`MessagePreparer` does what ``publish`` does before a message may enter a batch (and before flow
control could make the caller wait): type and size checks, the idempotency key, and the sizes the batch
counts with. It runs on the publishing thread, with no lock: its only shared state is a per-topic cache and
a counter, both safe to use from many threads at once in CPython.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from hedgepub._publisher.batch import field_size, request_overhead, varint_size
from hedgepub._settings import MAX_REQUEST_BYTES
from hedgepub._transport.grpc import PubsubMessagePb

#: The service's limits on a message's attributes and ordering key (Pub/Sub's documented quotas). The
#: service refuses a request holding one message beyond them whole, with every message batched beside it;
#: refused at the call, that message fails alone.
MAX_ATTRIBUTES = 100
MAX_ATTRIBUTE_KEY_BYTES = 256
MAX_ATTRIBUTE_VALUE_BYTES = 1024
MAX_ORDERING_KEY_BYTES = 1024


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
            if len(ordering_key) * 4 > MAX_ORDERING_KEY_BYTES and (
                len(ordering_key.encode("utf-8")) > MAX_ORDERING_KEY_BYTES
            ):
                raise ValueError(
                    f"the ordering key is {len(ordering_key.encode('utf-8'))} bytes; the service takes at "
                    f"most {MAX_ORDERING_KEY_BYTES}"
                )
        stamp = self.idempotency_attribute
        if stamp is not None and stamp not in attributes:
            # Stamped once, into the request every attempt sends: hedges and retries carry the same key.
            # A key the caller set is kept, so an application that republishes keeps its key too.
            attributes[stamp] = f"{self._key_prefix}-{next(self._message_keys)}"
        if not data and not attributes:
            # The service refuses a request holding such a message whole, with every message batched
            # beside it: refused here, it fails alone.
            raise ValueError("the message is empty: a message needs non-empty data or at least one attribute")
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

    def prepare_many(self, topic: str, messages: Iterable[Any], ordering_key: str) -> ManyMessages:
        """Check every message of one ``publish_many`` call, before any is published: each is ``bytes``
        (data alone), ``(data, attributes)``, or an object with ``data`` and optionally ``attributes`` and
        ``ordering_key`` (a ``PubsubMessage``); ``ordering_key`` applies to those without their own.

        Raises ``TypeError`` or ``ValueError`` naming the first bad message (``messages[i]: ...``).
        """
        if isinstance(messages, (bytes, bytearray, str)):
            raise TypeError(
                "messages must be a sequence of messages (bytes, (data, attributes) or PubsubMessage), not "
                f"{type(messages).__name__}: publish one message with publish()"
            )
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str; got {type(topic).__name__}")
        if ordering_key and not isinstance(ordering_key, str):
            raise TypeError(f"ordering_key must be a str; got {type(ordering_key).__name__}")
        items = messages if isinstance(messages, list) else list(messages)
        if not ordering_key and self.idempotency_attribute is None and set(map(type, items)) <= {bytes}:
            lengths = set(map(len, items))
            if not lengths or (0 not in lengths and max(lengths) < _SHORT):  # an empty one: checked below
                if len(lengths) <= 1:
                    return ManyMessages(
                        items, _framed_plain(lengths.pop() if lengths else 0), None, None, False
                    )
                return ManyMessages(
                    items, [_framed_plain(length) for length in map(len, items)], None, None, False
                )
        payloads: list[bytes] = []
        raw: list[Any] = []
        framed: list[int] = []
        elements: list[tuple[bytes, str, dict[str, Any]]] = []
        keyed = False
        for index, item in enumerate(items):
            try:
                data, key, attributes = (
                    (item, ordering_key, {}) if type(item) is bytes else _element(item, ordering_key)
                )
                message, _size, framed_size = self.prepare(topic, data, key, attributes)
            except (TypeError, ValueError) as error:
                raise type(error)(f"messages[{index}]: {error}") from None
            keyed = keyed or bool(key)
            payloads.append(data)
            raw.append(message)
            framed.append(framed_size)
            elements.append((data, key, attributes))
        return ManyMessages(payloads, framed, raw, elements, keyed)


class ManyMessages:
    """The messages of one ``publish_many`` call, checked: see :meth:`MessagePreparer.prepare_many`."""

    __slots__ = ("elements", "framed", "keyed", "messages", "payloads")

    def __init__(
        self,
        payloads: list[bytes],
        framed: int | list[int],
        messages: list[Any] | None,
        elements: list[tuple[bytes, str, dict[str, Any]]] | None,
        keyed: bool,
    ) -> None:
        #: Each message's data, in order.
        self.payloads = payloads
        #: The bytes each takes in a request: one figure when they all take the same, else one each.
        self.framed = framed
        #: Each message as a raw ``PubsubMessage`` (``None`` for data alone), or ``None`` if all are data
        #: alone.
        self.messages = messages
        #: Each message as (data, ordering key, attributes), for publishing them one by one; ``None`` if
        #: all are data alone without an ordering key.
        self.elements = elements
        #: Whether any message has an ordering key.
        self.keyed = keyed

    def one_by_one(self) -> list[tuple[bytes, str, dict[str, Any]]]:
        """Each message as (data, ordering key, attributes)."""
        if self.elements is not None:
            return self.elements
        return [(data, "", {}) for data in self.payloads]


#: Payloads shorter than this take ``length + 5`` bytes or fewer in a request (one- or two-byte lengths).
_SHORT = 0x3FF0


class _Missing:
    pass


def _element(item: Any, ordering_key: str) -> tuple[Any, str, dict[str, Any]]:
    """One ``publish_many`` message as (data, ordering key, attributes): bytes, ``(data, attributes)``, or
    an object with ``data`` (and ``attributes``, ``ordering_key``) such as a ``PubsubMessage``."""
    if isinstance(item, tuple):
        if len(item) != 2:
            raise TypeError(f"a message tuple is (data, attributes); got {len(item)} items")
        data, attributes = item
        return data, ordering_key, _attributes(attributes)
    data = getattr(item, "data", _Missing)
    if data is _Missing:
        raise TypeError(
            f"a message is bytes, (data, attributes) or an object with .data (a PubsubMessage); got "
            f"{type(item).__name__}"
        )
    key = getattr(item, "ordering_key", "") or ordering_key
    return data, key, _attributes(getattr(item, "attributes", None))


def _attributes(attributes: Any) -> dict[str, Any]:
    if not attributes:
        return {}
    if not isinstance(attributes, Mapping) and not hasattr(attributes, "items"):
        raise TypeError(f"attributes must be a mapping of text to text; got {type(attributes).__name__}")
    return dict(attributes.items())


def _framed_plain(length: int) -> int:
    """Bytes a payload of ``length`` (below ``_SHORT``) takes framed in a request as data alone."""
    size = (length + 2 if length < 0x80 else length + 3) if length else 0
    return size + 2 if size < 0x80 else size + 3


def check_attributes(attributes: dict[str, Any]) -> dict[str, Any]:
    """Attribute values must be text; UTF-8 ``bytes`` are decoded, as the official client does. Keys and
    values are held to the service's limits (:data:`MAX_ATTRIBUTES` and the sizes), and a key must not
    start with ``goog`` in any case (the service's own), except ``googclient_`` (the clients' own)."""
    if len(attributes) > MAX_ATTRIBUTES:
        raise ValueError(
            f"a message has {len(attributes)} attributes; the service takes at most {MAX_ATTRIBUTES}"
        )
    for name, value in attributes.items():
        if type(value) is not str and not isinstance(value, str):
            if isinstance(value, (bytes, bytearray)):
                try:
                    value = attributes[name] = bytes(value).decode("utf-8")
                except UnicodeDecodeError:
                    value = None
            if value is None or not isinstance(value, str):
                if name in ("retry", "timeout"):
                    raise TypeError(
                        f"publish(..., {name}=...) per message is the official client's argument; hedgepub "
                        "sets it for the whole client: pass retry_settings=hedgepub.RetrySettings(...) (or "
                        "publisher_options=...) to PublisherClient instead"
                    )
                raise TypeError(
                    f"attribute {name!r} must be a str (text); got {type(attributes[name]).__name__}. "
                    "All attributes published to Pub/Sub must be text strings."
                )
        if not isinstance(name, str):
            raise TypeError(f"attribute keys must be str; got {type(name).__name__}")
        if not name:
            raise ValueError("attribute keys must not be empty")
        # A character is at most 4 bytes in UTF-8: most keys and values need no encoding to be measured.
        if len(name) * 4 > MAX_ATTRIBUTE_KEY_BYTES and len(name.encode("utf-8")) > MAX_ATTRIBUTE_KEY_BYTES:
            raise ValueError(
                f"attribute key {name[:40]!r}... is {len(name.encode('utf-8'))} bytes; the service takes at "
                f"most {MAX_ATTRIBUTE_KEY_BYTES}"
            )
        if (
            len(value) * 4 > MAX_ATTRIBUTE_VALUE_BYTES
            and len(value.encode("utf-8")) > MAX_ATTRIBUTE_VALUE_BYTES
        ):
            raise ValueError(
                f"attribute {name!r} is {len(value.encode('utf-8'))} bytes; the service takes values of at "
                f"most {MAX_ATTRIBUTE_VALUE_BYTES}"
            )
        if name[:4].lower() == "goog" and not name.startswith("googclient_"):
            raise ValueError(
                f"attribute key {name!r} starts with 'goog': the service keeps such keys for itself"
            )
    return attributes
