"""Whether a Publish request's messages all carry data and nothing else, proven in C.

:func:`~hedgepub.server._pubsub.resources.check_publish` checks every message of a request against the
service's limits (:func:`~hedgepub.server._pubsub.limits.check_message`): a loop in Python that touched
three fields of each message and cost a Publish of 100 messages about 100 us, more than parsing it. Most
requests hold messages with data alone, for which only one of those rules can fail (a message must not be
empty) and the data's size is bounded by the request's. :func:`plain` answers whether a request is of
that kind without a Python step per message: it parses the request's bytes again as a
:data:`DataOnlyRequest`, whose messages know ``data`` alone, as a proto2 ``required`` field:

* every message has data: ``IsInitialized()`` (a message without the field is not). The bytes are the
  request serialized again by protobuf here, and proto3 never writes an empty ``bytes`` field, so a
  message present in them has data that is not empty;
* no message has anything else (attributes, an ordering key, a message ID, a publish time, a field this
  version does not know): every other field is unknown to :data:`DataOnlyRequest`, and dropping the
  unknown fields leaves the bytes as long as they were only if there were none.

Any other request takes the per-message checks, which decide exactly as before.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

__all__ = ["DataOnlyRequest", "plain"]


def _data_only_request() -> Any:
    """The message class of a ``PublishRequest`` (topic = 1, messages = 2) whose messages have only a
    required ``data`` (= 1), in a descriptor pool of its own."""
    field = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(
        name="hedgepub/server/plain_publish.proto", package="hedgepub.plainpublish", syntax="proto2"
    )
    message = file.message_type.add(name="DataOnly")
    message.field.add(name="data", number=1, type=field.TYPE_BYTES, label=field.LABEL_REQUIRED)
    request = file.message_type.add(name="DataOnlyRequest")
    request.field.add(name="topic", number=1, type=field.TYPE_STRING, label=field.LABEL_OPTIONAL)
    request.field.add(
        name="messages",
        number=2,
        type=field.TYPE_MESSAGE,
        label=field.LABEL_REPEATED,
        type_name=".hedgepub.plainpublish.DataOnly",
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    found = pool.FindMessageTypeByName("hedgepub.plainpublish.DataOnlyRequest")
    return message_factory.GetMessageClass(found)


#: A ``PublishRequest`` seen as its topic and each message's data (see the module's docstring).
DataOnlyRequest: Any = _data_only_request()


def plain(request: Any) -> tuple[bool, int]:
    """Whether every message of the ``PublishRequest`` ``request`` has data (not empty) and no other field,
    and the request's serialized size (which bounds any message's data)."""
    serialized = request.SerializeToString()
    size = len(serialized)
    slim = DataOnlyRequest.FromString(serialized)
    if not slim.IsInitialized():
        return False, size
    slim.DiscardUnknownFields()
    return slim.ByteSize() == size, size
