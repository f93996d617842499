"""The REST methods ``projects.validateMessageTransform`` and ``projects.testMessageTransforms``.

What ``gcloud pubsub message-transforms validate`` and ``test`` call. The installed client's protos do
not carry these methods (there is no gRPC request class to transcode to), so the REST face answers them
itself, in the proto3 JSON mapping of the REST API:

- ``POST /v1/projects/P:validateMessageTransform`` with ``{"messageTransform": {...}}``: ``{}`` when the
  transform would be accepted on a topic or subscription, else the error a CreateTopic would give.
- ``POST /v1/projects/P:testMessageTransforms`` with ``{"message": {...}}`` and the transforms to apply:
  inline (``"messageTransforms": {"messageTransforms": [...]}``) or a ``"topic"``'s or
  ``"subscription"``'s (read through the gRPC face, so IAM applies as to GetTopic and GetSubscription).
  The answer lists what each enabled transform made of the message, up to the first that filtered it
  (``filteredMessage``) or failed (``failedMessage`` with the error).
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import json_format
from google.pubsub_v1.types import pubsub as pubsub_types

from hedgepub.server._pubsub import limits
from hedgepub.server._pubsub.limits import ServiceError, invalid
from hedgepub.server._pubsub.transforms import Pipeline, check_transform, check_transforms

__all__ = ["TRANSFORM_METHODS", "answer", "match"]

PubsubMessage: Any = pubsub_types.PubsubMessage.pb()
MessageTransform: Any = pubsub_types.MessageTransform.pb()

TRANSFORM_METHODS = ("validateMessageTransform", "testMessageTransforms")
_PATH = re.compile(r"/v1/(projects/[^/:]+):(validateMessageTransform|testMessageTransforms)\Z")

#: Reads a topic's or subscription's ``message_transforms`` (``"topic"`` or ``"subscription"``, name).
Fetch = Callable[[str, str], Awaitable[Any]]


def match(http_method: str, raw_path: str) -> tuple[str, str] | None:
    """``(project, method)`` when the call is one of the two methods, else ``None``."""
    if http_method != "POST":
        return None
    found = _PATH.match(raw_path)
    return (found.group(1), found.group(2)) if found else None


def _parse(body: bytes, message: Any, field: str) -> Any:
    try:
        json_format.Parse(body or b"{}", message)
    except json_format.ParseError as error:
        raise invalid(f"Invalid JSON payload received. {error}") from None
    return message


def _validate(body: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(body or b"{}")
    except ValueError as error:
        raise invalid(f"Invalid JSON payload received. {error}") from None
    if not isinstance(payload, dict) or "messageTransform" not in payload:
        raise invalid("messageTransform is required.")
    transform = MessageTransform()
    _parse(json.dumps(payload["messageTransform"]).encode(), transform, "messageTransform")
    check_transform(transform, "message_transform")
    return {}


async def _test(body: bytes, fetch: Fetch) -> dict[str, Any]:
    try:
        payload = json.loads(body or b"{}")
    except ValueError as error:
        raise invalid(f"Invalid JSON payload received. {error}") from None
    if not isinstance(payload, dict):
        raise invalid("Invalid JSON payload received: an object is expected.")
    message = _parse(json.dumps(payload.get("message", {})).encode(), PubsubMessage(), "message")
    sources = [key for key in ("messageTransforms", "topic", "subscription") if payload.get(key)]
    if len(sources) != 1:
        raise invalid("Exactly one of messageTransforms, topic or subscription must be given.")
    source = sources[0]
    if source == "messageTransforms":
        inline = payload["messageTransforms"]
        listed = inline.get("messageTransforms", []) if isinstance(inline, dict) else None
        if not isinstance(listed, list):
            raise invalid("messageTransforms.messageTransforms must be a list of MessageTransform.")
        transforms = [
            _parse(json.dumps(item).encode(), MessageTransform(), "messageTransforms") for item in listed
        ]
        check_transforms(transforms)
    else:
        name = payload[source]
        if source == "topic":
            limits.check_topic_name(name)
        else:
            limits.check_subscription_name(name)
        transforms = list((await fetch(source, name)).message_transforms)
    results = []
    for step in Pipeline(transforms).trace(message):
        if step.error is not None:
            code = grpc.StatusCode.INVALID_ARGUMENT
            results.append({"failedMessage": {"error": {"code": code.value[0], "message": step.error}}})
        elif step.message is None:
            results.append({"filteredMessage": {}})
        else:
            results.append({"transformedMessage": json_format.MessageToDict(step.message)})
    return {"transformedMessages": results} if results else {}


async def answer(method: str, body: bytes, fetch: Fetch) -> tuple[grpc.StatusCode, dict[str, Any] | str]:
    """Answer one call: OK and the JSON response, or an error code and its message."""
    try:
        if method == "validateMessageTransform":
            return grpc.StatusCode.OK, _validate(body)
        return grpc.StatusCode.OK, await _test(body, fetch)
    except ServiceError as error:
        return grpc.StatusCode[error.code.name], error.message
