"""The RPC methods the local server answers, by service, and how a rule or a count names one of them.

A method is named by its short name (``"Publish"``), its full gRPC path
(``"/google.pubsub.v1.Publisher/Publish"``) or, for a fault rule, ``"*"``: every method without a rule
of its own. The table lists the methods of the services' .proto files, implemented or not, so that a
fault can target a method the server does not implement (it then answers UNIMPLEMENTED after the fault).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["METHODS", "SHORT_NAMES", "STREAMING", "WILDCARD", "resolve_method", "short_name"]

# The RPC methods of the services the server speaks, as in their .proto files. A test checks this
# table against the descriptors shipped with google-cloud-pubsub and grpc-google-iam-v1.
_SERVICES: Mapping[str, tuple[str, ...]] = {
    "google.pubsub.v1.Publisher": (
        "CreateTopic",
        "UpdateTopic",
        "Publish",
        "GetTopic",
        "ListTopics",
        "ListTopicSubscriptions",
        "ListTopicSnapshots",
        "DeleteTopic",
        "DetachSubscription",
    ),
    "google.pubsub.v1.Subscriber": (
        "CreateSubscription",
        "GetSubscription",
        "UpdateSubscription",
        "ListSubscriptions",
        "DeleteSubscription",
        "ModifyAckDeadline",
        "Acknowledge",
        "Pull",
        "StreamingPull",
        "ModifyPushConfig",
        "GetSnapshot",
        "ListSnapshots",
        "CreateSnapshot",
        "UpdateSnapshot",
        "DeleteSnapshot",
        "Seek",
    ),
    "google.iam.v1.IAMPolicy": ("SetIamPolicy", "GetIamPolicy", "TestIamPermissions"),
    "google.pubsub.v1.SchemaService": (
        "CreateSchema",
        "GetSchema",
        "ListSchemas",
        "ListSchemaRevisions",
        "CommitSchema",
        "RollbackSchema",
        "DeleteSchemaRevision",
        "DeleteSchema",
        "ValidateSchema",
        "ValidateMessage",
    ),
}

#: Short method name -> full gRPC path, for every method a rule can target.
METHODS: Mapping[str, str] = MappingProxyType(
    {method: f"/{service}/{method}" for service, methods in _SERVICES.items() for method in methods}
)
#: Full gRPC path -> short method name.
SHORT_NAMES: Mapping[str, str] = {path: short for short, path in METHODS.items()}
#: Only StreamingPull streams (in both directions); every other method is unary-unary.
STREAMING = frozenset({"StreamingPull"})

#: The method name of a rule that applies to every method that has no rule of its own.
WILDCARD = "*"


def resolve_method(name: str) -> str:
    """Return the full gRPC path of a method given by short name or full path (``"*"`` stays ``"*"``).

    Raises ``ValueError`` listing the valid names when ``name`` is none of them.
    """
    if not isinstance(name, str):
        raise TypeError(f"method must be a str; got {type(name).__name__} {name!r}")
    stripped = name.strip()
    if stripped == WILDCARD:
        return WILDCARD
    if stripped in METHODS:
        return METHODS[stripped]
    if stripped in SHORT_NAMES:
        return stripped
    raise ValueError(
        f"unknown RPC method {name!r}; valid methods are {WILDCARD!r} (all), "
        + ", ".join(METHODS)
        + " (or their full paths, such as '/google.pubsub.v1.Publisher/Publish')"
    )


def short_name(path: str) -> str:
    """The short name of the method at full gRPC ``path`` (``path`` itself when it is none of ours)."""
    return SHORT_NAMES.get(path, path)
