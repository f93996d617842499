"""The one table of the ``google.pubsub.v1`` RPCs, derived from the client package's protocol
descriptions: what the local server answers and the proxy forwards.

:data:`RPCS` lists every method of the ``google.pubsub.v1`` services (Publisher, Subscriber,
SchemaService) and of ``google.iam.v1.IAMPolicy``, each with its request and response classes (raw
protobuf) and whether it streams. Nothing here is written out by hand: the methods come from the
``gapic_metadata.json`` that google-cloud-pubsub ships, their message types from its transports' type
hints, and IAMPolicy from its descriptor in grpc-google-iam-v1. The server's gRPC face serves this table
(a method is the servicer's method of the same name), IAM enforcement has a permission entry for each, and
``hedgepub proxy`` forwards each; tests check all three.

It lives in the base package (it needs google-cloud-pubsub alone) so that the proxy does not import the
server; how a fault rule or a count names a method (``"*"`` included) is in ``hedgepub.server._methods``.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import typing
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import google.pubsub_v1
from google.iam.v1 import iam_policy_pb2
from google.protobuf import message_factory

__all__ = ["METHODS", "RPCS", "SHORT_NAMES", "STREAMING", "Rpc"]

#: The package of the ``google.pubsub.v1`` services' generated clients.
_PUBSUB_SERVICES = {
    "Publisher": ("publisher", "PublisherTransport", "PublisherClient"),
    "Subscriber": ("subscriber", "SubscriberTransport", "SubscriberClient"),
    "SchemaService": ("schema_service", "SchemaServiceTransport", "SchemaServiceClient"),
}


@dataclasses.dataclass(frozen=True)
class Rpc:
    """One RPC method: its service, short name, message classes (raw protobuf) and kind."""

    #: The full service name, ``"google.pubsub.v1.Publisher"``.
    service: str
    #: The method's short name, ``"Publish"``.
    name: str
    #: The raw protobuf class of its request (of each request, for a streaming method).
    request_class: Any
    #: The raw protobuf class of its response.
    response_class: Any
    #: Whether requests and responses stream (StreamingPull); every other method is unary-unary.
    streaming: bool = False

    @property
    def path(self) -> str:
        """The full gRPC path, ``"/google.pubsub.v1.Publisher/Publish"``."""
        return f"/{self.service}/{self.name}"


def _raw(message_class: Any) -> Any:
    """The raw protobuf class of a proto-plus wrapper (a raw class stays as it is)."""
    pb = getattr(message_class, "pb", None)
    return pb() if callable(pb) else message_class


def _pubsub_rpcs() -> list[Rpc]:
    metadata = json.loads((Path(google.pubsub_v1.__file__).parent / "gapic_metadata.json").read_text())
    found = []
    for service, (package, transport_name, client_name) in _PUBSUB_SERVICES.items():
        services = f"google.pubsub_v1.services.{package}"
        transport = getattr(importlib.import_module(f"{services}.transports.base"), transport_name)
        client = getattr(importlib.import_module(services), client_name)
        rpcs = metadata["services"][service]["clients"]["grpc"]["rpcs"]
        for name, entry in rpcs.items():
            attribute = entry["methods"][0]
            # The transport's property is typed Callable[[Request], Union[Response, Awaitable[Response]]].
            hint = typing.get_type_hints(getattr(transport, attribute).fget)["return"]
            (request,), outcome = typing.get_args(hint)
            response = typing.get_args(outcome)[0]
            # A streaming method's client takes ``requests`` (an iterator of them), a unary one ``request``.
            streaming = "requests" in inspect.signature(getattr(client, attribute)).parameters
            found.append(Rpc(f"google.pubsub.v1.{service}", name, _raw(request), _raw(response), streaming))
    return found


def _iam_rpcs() -> list[Rpc]:
    service = iam_policy_pb2.DESCRIPTOR.services_by_name["IAMPolicy"]
    return [
        Rpc(
            service.full_name,
            method.name,
            message_factory.GetMessageClass(method.input_type),
            message_factory.GetMessageClass(method.output_type),
            method.client_streaming or method.server_streaming,
        )
        for method in service.methods
    ]


#: Short method name -> :class:`Rpc`, for every method of the services the server speaks.
RPCS: Mapping[str, Rpc] = MappingProxyType({rpc.name: rpc for rpc in (*_pubsub_rpcs(), *_iam_rpcs())})
#: Short method name -> full gRPC path, for every method a rule can target.
METHODS: Mapping[str, str] = MappingProxyType({name: rpc.path for name, rpc in RPCS.items()})
#: Full gRPC path -> short method name.
SHORT_NAMES: Mapping[str, str] = MappingProxyType({path: short for short, path in METHODS.items()})
#: The methods that stream (in both directions): StreamingPull.
STREAMING = frozenset(name for name, rpc in RPCS.items() if rpc.streaming)
