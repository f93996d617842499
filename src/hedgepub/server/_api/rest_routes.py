"""REST routes and transcoding: which HTTP rule answers a request, how it becomes the gRPC request, and
how a gRPC answer or error becomes Google's JSON.

The routes are not written here: :func:`routes` reads them from the REST transports that the installed
``google-cloud-pubsub`` package generates from the protos' ``google.api.http`` rules (verb, URI template,
body field), and the request and response classes from the same transports' signatures. A method the
package gains is routed without new code; one with no HTTP rule (the bidirectional ``StreamingPull``) has
no route, as in the real service. :mod:`.rest` serves them over HTTP/1.1.
"""

from __future__ import annotations

import functools
import importlib
import logging
import re
import typing
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
from google.api_core import exceptions as api_exceptions
from google.iam.v1 import iam_policy_pb2
from google.protobuf import descriptor, empty_pb2, json_format
from google.protobuf.message import DecodeError, Message
from google.rpc import error_details_pb2, status_pb2

from hedgepub.server._pubsub.limits import ServiceError
from hedgepub.server._pubsub.nesting import load_json

logger = logging.getLogger("hedgepub.server")

#: The generated REST transports of the installed client package, and the gRPC service each one calls.
#: Methods of ``google.iam.v1.IAMPolicy`` appear in every transport (as mixins); they go to that service.
REST_TRANSPORTS: tuple[tuple[str, str, str], ...] = (
    (
        "google.pubsub_v1.services.publisher.transports.rest",
        "PublisherRestTransport",
        "google.pubsub.v1.Publisher",
    ),
    (
        "google.pubsub_v1.services.subscriber.transports.rest",
        "SubscriberRestTransport",
        "google.pubsub.v1.Subscriber",
    ),
    (
        "google.pubsub_v1.services.schema_service.transports.rest",
        "SchemaServiceRestTransport",
        "google.pubsub.v1.SchemaService",
    ),
)
_IAM_SERVICE = iam_policy_pb2.DESCRIPTOR.services_by_name["IAMPolicy"]

#: Query parameters every Google API accepts that are not request fields ("alt=json" comes with every
#: gcloud call); they are ignored rather than refused.
SYSTEM_PARAMETERS = frozenset({"alt", "prettyPrint", "$.xgafv", "key", "fields", "quotaUser", "callback"})

_VARIABLE = re.compile(r"\{([\w.]+)(?:=([^}]*))?\}")


@dataclass(frozen=True)
class Route:
    """One HTTP rule of one gRPC method: ``PUT /v1/{name=projects/*/topics/*}`` -> ``CreateTopic``."""

    http_method: str
    template: str
    #: The request field the body fills: ``"*"`` (the whole request), a field name, or ``""`` (no body).
    body: str
    #: ``/package.Service/Method``, the gRPC method the call goes to.
    grpc_method: str
    request_class: Any
    response_class: Any
    pattern: re.Pattern[str]
    #: The request field (dotted path) each group of ``pattern`` fills, in order.
    path_fields: tuple[str, ...]

    @property
    def name(self) -> str:
        """The short method name, ``CreateTopic``."""
        return self.grpc_method.rsplit("/", 1)[-1]


def compile_template(template: str) -> tuple[re.Pattern[str], tuple[str, ...]]:
    """The regular expression matching a URI template's raw (still percent-encoded) paths, and its fields.

    ``*`` stands for one path segment, ``**`` for one or more. Resource names never hold ``:``, which
    starts a custom verb (``:publish``), so a segment stops there.
    """
    parts: list[str] = []
    fields: list[str] = []
    position = 0
    for match in _VARIABLE.finditer(template):
        parts.append(re.escape(template[position : match.start()]))
        fields.append(match.group(1))
        segments = (match.group(2) or "*").split("/")
        pattern = "/".join(
            "[^/:]+" if segment == "*" else "[^:]+" if segment == "**" else re.escape(segment)
            for segment in segments
        )
        parts.append(f"({pattern})")
        position = match.end()
    parts.append(re.escape(template[position:]))
    return re.compile("".join(parts) + r"\Z"), tuple(fields)


def _protobuf_class(annotation: Any) -> Any:
    """The raw protobuf class behind a signature's annotation (proto-plus wrapper, pb2 class or None)."""
    if annotation is None or annotation is type(None):
        return empty_pb2.Empty
    pb = getattr(annotation, "pb", None)
    return pb() if callable(pb) else annotation


@functools.lru_cache(maxsize=1)
def routes() -> tuple[Route, ...]:
    """Every HTTP rule of every method of the client package's REST transports, each once."""
    found: dict[tuple[str, str], Route] = {}
    iam_methods = {method.name for method in _IAM_SERVICE.methods}
    for module_name, transport_name, service in REST_TRANSPORTS:
        transport = getattr(importlib.import_module(module_name), transport_name)
        for attribute in sorted(vars(transport)):
            stub = getattr(transport, attribute)
            method = attribute[1:]
            if not (attribute.startswith("_") and method[:1].isupper() and isinstance(stub, type)):
                continue
            http_options = getattr(stub, "_get_http_options", None)
            if http_options is None:  # no HTTP rule: StreamingPull
                continue
            hints = typing.get_type_hints(stub.__call__)
            owner = _IAM_SERVICE.full_name if method in iam_methods else service
            for option in http_options():
                pattern, fields = compile_template(option["uri"])
                route = Route(
                    http_method=option["method"].upper(),
                    template=option["uri"],
                    body=option.get("body", ""),
                    grpc_method=f"/{owner}/{method}",
                    request_class=_protobuf_class(hints["request"]),
                    response_class=_protobuf_class(hints.get("return")),
                    pattern=pattern,
                    path_fields=fields,
                )
                found.setdefault((route.http_method, route.template), route)
    return tuple(found.values())


class RestError(Exception):
    """A REST call refused before (or instead of) reaching the gRPC face: a gRPC status and message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def http_status(code: grpc.StatusCode) -> int:
    """The HTTP status the real service answers a gRPC status code with (500 where it names none)."""
    if code == grpc.StatusCode.OK:
        return 200
    return int(api_exceptions.exception_class_for_grpc_status(code).code or 500)


def error_body(code: grpc.StatusCode, message: str, details: Iterable[dict[str, Any]] = ()) -> dict[str, Any]:
    """Google's JSON error form for a gRPC status; ``details`` (JSON ``Any`` objects) when there are any."""
    body: dict[str, Any] = {"code": http_status(code), "message": message, "status": code.name}
    details = list(details)
    if details:
        body["details"] = details
    return {"error": body}


#: The trailer in which a gRPC status carries its ``google.rpc.Status`` (with details).
STATUS_DETAILS_METADATA = "grpc-status-details-bin"

# The JSON mapping of an Any needs its type in the default descriptor pool: importing the module that
# defines the standard error details (ErrorInfo, RetryInfo, BadRequest, ...) registers them.
_ERROR_DETAIL_TYPES = error_details_pb2.DESCRIPTOR


def status_details(trailing_metadata: Iterable[tuple[str, str | bytes]] | None) -> list[dict[str, Any]]:
    """The details of a failed call's ``google.rpc.Status`` trailer, each in the proto3 JSON mapping of
    ``google.protobuf.Any`` (``{"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": ...}``).

    Empty when the trailer is absent; a trailer that does not parse, or a detail of a type this process
    does not know, is left out (and logged) rather than failing the answer.
    """
    for key, value in trailing_metadata or ():
        if key != STATUS_DETAILS_METADATA or not isinstance(value, bytes):
            continue
        try:
            status = status_pb2.Status.FromString(value)
        except DecodeError:
            logger.warning("REST: a %s trailer that does not parse was left out", STATUS_DETAILS_METADATA)
            return []
        details: list[dict[str, Any]] = []
        for detail in status.details:
            try:
                details.append(json_format.MessageToDict(detail))
            except (TypeError, json_format.Error) as error:
                logger.warning("REST: status detail %s left out: %s", detail.type_url, error)
        return details
    return []


def _field_path(message_descriptor: descriptor.Descriptor, path: str) -> list[descriptor.FieldDescriptor]:
    """The fields along a dotted path whose parts are proto (``page_size``) or JSON (``pageSize``) names."""
    fields: list[descriptor.FieldDescriptor] = []
    current: descriptor.Descriptor | None = message_descriptor
    for part in path.split("."):
        field = None
        if current is not None:
            field = current.fields_by_name.get(part) or next(
                (candidate for candidate in current.fields if candidate.json_name == part), None
            )
        if field is None:
            raise RestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f'Invalid JSON payload received. Unknown name "{path}": Cannot bind query parameter. '
                f"Field '{part}' could not be found in request message.",
            )
        fields.append(field)
        current = field.message_type
    return fields


def _query_value(field: descriptor.FieldDescriptor, text: str) -> Any:
    """A query parameter's text as the JSON value the proto3 JSON parser expects for ``field``."""
    if field.type == descriptor.FieldDescriptor.TYPE_BOOL:
        if text.lower() in ("true", "1"):
            return True
        if text.lower() in ("false", "0"):
            return False
        raise RestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"Invalid value at '{field.json_name}' (TYPE_BOOL), \"{text}\"",
        )
    return text


def query_to_json(
    message_descriptor: descriptor.Descriptor, query: Iterable[tuple[str, str]]
) -> dict[str, Any]:
    """Query parameters (``pageSize=10``, ``options.requestedPolicyVersion=3``) as a proto3 JSON object."""
    values: dict[str, list[str]] = {}
    for name, value in query:
        if name not in SYSTEM_PARAMETERS:
            values.setdefault(name, []).append(value)
    result: dict[str, Any] = {}
    for name, texts in values.items():
        fields = _field_path(message_descriptor, name)
        target = result
        for field in fields[:-1]:
            target = target.setdefault(field.name, {})
        last = fields[-1]
        if last.message_type is not None and last.message_type.full_name not in _SCALAR_LIKE_MESSAGES:
            raise RestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f'Invalid JSON payload received. Unknown name "{name}": Cannot bind query parameter. '
                f"Field '{last.name}' is a message and cannot be given as a query parameter.",
            )
        converted = [_query_value(last, text) for text in texts]
        target[last.name] = converted if _is_repeated(last) else converted[-1]
    return result


#: Message types whose proto3 JSON form is a string, so a query parameter can carry them.
_SCALAR_LIKE_MESSAGES = frozenset(
    {
        "google.protobuf.FieldMask",
        "google.protobuf.Duration",
        "google.protobuf.Timestamp",
        "google.protobuf.StringValue",
        "google.protobuf.Int64Value",
        "google.protobuf.Int32Value",
        "google.protobuf.BoolValue",
    }
)


def _is_repeated(field: descriptor.FieldDescriptor) -> bool:
    is_repeated = getattr(field, "is_repeated", None)  # protobuf >= 6; older releases only have label
    if is_repeated is not None:
        return bool(is_repeated)
    # protobuf < 6 (whose FieldDescriptor the current stubs no longer describe)
    return bool(field.label == descriptor.FieldDescriptor.LABEL_REPEATED)  # type: ignore[attr-defined]


def _set_path_field(request: Message, path: str, value: str) -> None:
    parts = path.split(".")
    target = request
    for part in parts[:-1]:
        target = getattr(target, part)
    setattr(target, parts[-1], value)


def _parse_json(text: bytes, message: Message) -> None:
    try:
        document = load_json(text, "The JSON payload")
    except ValueError as error:
        raise RestError(grpc.StatusCode.INVALID_ARGUMENT, f"Invalid JSON payload received. {error}") from None
    except ServiceError as error:
        raise RestError(
            grpc.StatusCode.INVALID_ARGUMENT, f"Invalid JSON payload received. {error.message}"
        ) from None
    if not isinstance(document, dict):
        raise RestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"Invalid JSON payload received. Expected an object, got {type(document).__name__}: "
            f"{text[:40].decode('utf-8', 'replace')!r}.",
        )
    parse_document(document, message)


def parse_document(document: dict[str, Any], message: Message) -> None:
    """Fill ``message`` from a JSON object already loaded (and depth-checked) in the proto3 JSON mapping;
    INVALID_ARGUMENT (:class:`RestError`) for base64 that is not base64, unknown names, wrong types."""
    # The stubs allow upb's descriptor class too, which has the same fields.
    _check_base64(document, typing.cast(descriptor.Descriptor, message.DESCRIPTOR))
    try:
        json_format.ParseDict(document, message)
    except (json_format.ParseError, RecursionError, TypeError, ValueError) as error:
        raise RestError(grpc.StatusCode.INVALID_ARGUMENT, f"Invalid JSON payload received. {error}") from None


#: Base64 as the proto3 JSON mapping takes it for ``bytes``: the standard or the URL-safe alphabet, with or
#: without padding, and nothing else (the protobuf library itself drops characters outside the alphabet).
_BASE64 = re.compile(r"[A-Za-z0-9+/_-]*={0,2}\Z")


def _check_base64(document: dict[str, Any], message_descriptor: descriptor.Descriptor) -> None:
    """Refuse a ``bytes`` field of the JSON ``document`` whose text is not base64 (a loop, no recursion)."""
    pending: list[tuple[Any, descriptor.Descriptor, str]] = [(document, message_descriptor, "")]
    while pending:
        value, current, path = pending.pop()
        if not isinstance(value, dict):
            continue
        for name, item in value.items():
            field = current.fields_by_name.get(name) or next(
                (candidate for candidate in current.fields if candidate.json_name == name), None
            )
            if field is None:
                continue  # the JSON parser says what is wrong with an unknown name
            where = f"{path}{name}"
            if field.message_type is not None and field.message_type.GetOptions().map_entry:
                value_field = field.message_type.fields_by_name["value"]
                if isinstance(item, dict):
                    for key, entry in item.items():
                        _queue(pending, value_field, entry, f"{where}[{key!r}]")
                continue
            for index, element in enumerate(
                item if _is_repeated(field) and isinstance(item, list) else [item]
            ):
                _queue(pending, field, element, f"{where}[{index}]." if _is_repeated(field) else f"{where}.")


def _queue(
    pending: list[tuple[Any, descriptor.Descriptor, str]],
    field: descriptor.FieldDescriptor,
    value: Any,
    where: str,
) -> None:
    if field.type == descriptor.FieldDescriptor.TYPE_BYTES:
        if isinstance(value, str) and (len(value.rstrip("=")) % 4 == 1 or not _BASE64.match(value)):
            raise RestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"Invalid value at '{where.rstrip('.')}' (TYPE_BYTES), Base64 decoding failed for "
                f"{value[:40]!r}",
            )
    elif field.message_type is not None:
        pending.append((value, field.message_type, where))


def build_request(
    route: Route, path_values: Iterable[str], query: Iterable[tuple[str, str]], body: bytes
) -> Message:
    """The gRPC request of a REST call: the body, then query parameters, then path variables (which win)."""
    request = route.request_class()
    if body.strip():
        if not route.body:
            raise RestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"Invalid JSON payload received. {route.name} takes no request body.",
            )
        _parse_json(body, request if route.body == "*" else getattr(request, route.body))
    query_json = query_to_json(route.request_class.DESCRIPTOR, query)
    if query_json:
        try:
            json_format.ParseDict(query_json, request)
        except json_format.ParseError as error:
            raise RestError(grpc.StatusCode.INVALID_ARGUMENT, f"Invalid query parameter. {error}") from None
    for field, raw in zip(route.path_fields, path_values, strict=True):
        _set_path_field(request, field, urllib.parse.unquote(raw))
    return request


class RouteTable:
    """The routes by HTTP method, matched against a raw path."""

    def __init__(self, all_routes: Iterable[Route]) -> None:
        self._by_method: dict[str, list[Route]] = {}
        for route in all_routes:
            self._by_method.setdefault(route.http_method, []).append(route)

    def routes(self) -> list[Route]:
        """Every route of the table."""
        return [route for routes in self._by_method.values() for route in routes]

    def match(self, http_method: str, raw_path: str) -> tuple[Route, tuple[str, ...]]:
        """The route serving ``http_method raw_path`` and its path variables; NOT_FOUND when none does."""
        for route in self._by_method.get(http_method, ()):
            found = route.pattern.match(raw_path)
            if found:
                return route, found.groups()
        raise RestError(grpc.StatusCode.NOT_FOUND, f"No REST route matches {http_method} {raw_path}.")


def to_json(message: Message) -> bytes:
    """A response in the proto3 JSON mapping: camelCase names, base64 bytes, ``"10s"`` durations."""
    return json_format.MessageToJson(message, indent=2).encode()
