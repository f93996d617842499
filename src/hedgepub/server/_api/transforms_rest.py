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

Under IAM enforcement both authenticate as every route does, and need :data:`TRANSFORM_PERMISSIONS` in
the project; their bodies are checked as the other routes' are (depth, types, base64).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import json_format
from google.pubsub_v1.types import pubsub as pubsub_types

from hedgepub.server._api.rest_routes import RestError, parse_document
from hedgepub.server._pubsub import limits
from hedgepub.server._pubsub.limits import ServiceError, invalid
from hedgepub.server._pubsub.nesting import load_json
from hedgepub.server._pubsub.transforms import Transforms

__all__ = ["TRANSFORM_METHODS", "TRANSFORM_PERMISSIONS", "answer", "match"]

PubsubMessage: Any = pubsub_types.PubsubMessage.pb()
MessageTransform: Any = pubsub_types.MessageTransform.pb()

TRANSFORM_METHODS = ("validateMessageTransform", "testMessageTransforms")
_PATH = re.compile(r"/v1/(projects/[^/:]+):(validateMessageTransform|testMessageTransforms)\Z")

#: Reads a topic's or subscription's ``message_transforms`` (``"topic"`` or ``"subscription"``, name).
Fetch = Callable[[str, str], Awaitable[Any]]
#: Raises ServiceError unless the caller holds one of :data:`TRANSFORM_PERMISSIONS` in the project.
Authorize = Callable[[], Awaitable[None]]

#: What a caller needs in the project to validate or test transforms given inline: either permission that
#: lets it put transforms on a resource there (a topic's or subscription's own transforms are read with
#: GetTopic or GetSubscription, which need ``pubsub.topics.get`` or ``pubsub.subscriptions.get``).
TRANSFORM_PERMISSIONS = ("pubsub.topics.create", "pubsub.subscriptions.create")


def match(http_method: str, raw_path: str) -> tuple[str, str] | None:
    """``(project, method)`` when the call is one of the two methods, else ``None``."""
    if http_method != "POST":
        return None
    found = _PATH.match(raw_path)
    return (found.group(1), found.group(2)) if found else None


def _load(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, nested no deeper than the other routes take; INVALID_ARGUMENT else."""
    try:
        payload = load_json(body or b"{}", "The JSON payload")
    except ValueError as error:  # not JSON, or not UTF-8
        raise invalid(f"Invalid JSON payload received. {error}") from None
    if not isinstance(payload, dict):
        raise invalid(f"Invalid JSON payload received. Expected an object, got {type(payload).__name__}.")
    return payload


def _parse(document: object, message: Any, field: str) -> Any:
    """``message`` filled from ``document`` (a part of the body) as the other routes parse theirs."""
    if not isinstance(document, dict):
        raise invalid(
            f"Invalid JSON payload received. {field} must be an object, not {type(document).__name__}."
        )
    try:
        parse_document(document, message)
    except RestError as error:
        raise invalid(error.message) from None
    return message


async def _validate(body: bytes, authorize: Authorize, transforms: Transforms) -> dict[str, Any]:
    await authorize()
    payload = _load(body)
    if "messageTransform" not in payload:
        raise invalid("messageTransform is required.")
    transform = _parse(payload["messageTransform"], MessageTransform(), "messageTransform")
    await transforms.validate_one(transform, "message_transform")
    return {}


async def _test(body: bytes, authorize: Authorize, fetch: Fetch, run: Transforms) -> dict[str, Any]:
    payload = _load(body)
    message = _parse(payload.get("message", {}), PubsubMessage(), "message")
    sources = [key for key in ("messageTransforms", "topic", "subscription") if payload.get(key)]
    if len(sources) != 1:
        raise invalid("Exactly one of messageTransforms, topic or subscription must be given.")
    source = sources[0]
    if source == "messageTransforms":
        await authorize()
        inline = payload["messageTransforms"]
        listed = inline.get("messageTransforms", []) if isinstance(inline, dict) else None
        if not isinstance(listed, list):
            raise invalid("messageTransforms.messageTransforms must be a list of MessageTransform.")
        transforms = [_parse(item, MessageTransform(), "messageTransforms[]") for item in listed]
        await run.validate(transforms)
    else:
        name = payload[source]
        if not isinstance(name, str):
            raise invalid(
                f"Invalid JSON payload received. {source} must be a string, not {type(name).__name__}."
            )
        if source == "topic":
            limits.check_topic_name(name)
        else:
            limits.check_subscription_name(name)
        transforms = list((await fetch(source, name)).message_transforms)
    results = []
    for step in await run.trace(transforms, message):
        if step.error is not None:
            code = grpc.StatusCode.INVALID_ARGUMENT
            results.append({"failedMessage": {"error": {"code": code.value[0], "message": step.error}}})
        elif step.message is None:
            results.append({"filteredMessage": {}})
        else:
            results.append({"transformedMessage": json_format.MessageToDict(step.message)})
    return {"transformedMessages": results} if results else {}


async def _allowed() -> None:
    pass


async def answer(
    method: str, body: bytes, fetch: Fetch, transforms: Transforms, authorize: Authorize = _allowed
) -> tuple[grpc.StatusCode, dict[str, Any] | str]:
    """Answer one call: OK and the JSON response, or an error code and its message.

    ``authorize`` checks :data:`TRANSFORM_PERMISSIONS` (for a validation and for transforms given inline;
    ``fetch`` checks a topic's or subscription's); ``transforms`` (the server's) runs them.
    """
    try:
        if method == "validateMessageTransform":
            return grpc.StatusCode.OK, await _validate(body, authorize, transforms)
        return grpc.StatusCode.OK, await _test(body, authorize, fetch, transforms)
    except ServiceError as error:
        return grpc.StatusCode[error.code.name], error.message
