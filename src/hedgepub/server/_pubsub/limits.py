"""The real service's limits, resource-name rules and error messages, in one place.

Every check raises :class:`ServiceError` with the status code and wording of Google Cloud Pub/Sub, so that
the gRPC layer only has to translate it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from google.rpc import error_details_pb2

from hedgepub._status import StatusCode

#: Most messages in one Publish request.
MAX_MESSAGES_PER_PUBLISH = 1000
#: Largest Publish request, and largest message data, in bytes.
MAX_PUBLISH_REQUEST_BYTES = 10_000_000
MAX_MESSAGE_DATA_BYTES = 10_000_000
#: Most attributes on one message, and the largest key and value in bytes.
MAX_ATTRIBUTES = 100
MAX_ATTRIBUTE_KEY_BYTES = 256
MAX_ATTRIBUTE_VALUE_BYTES = 1024
#: Largest ordering key in bytes.
MAX_ORDERING_KEY_BYTES = 1024
#: Ack deadline of a subscription: default and range, in seconds.
DEFAULT_ACK_DEADLINE_SECONDS = 10
MIN_ACK_DEADLINE_SECONDS = 10
MAX_ACK_DEADLINE_SECONDS = 600
#: Message retention of a subscription (default) and of topics and subscriptions (range), in seconds.
DEFAULT_RETENTION_SECONDS = 7 * 24 * 3600
MIN_RETENTION_SECONDS = 10 * 60
MAX_RETENTION_SECONDS = 31 * 24 * 3600
#: Retry policy: defaults and range of minimum_backoff and maximum_backoff, in seconds.
DEFAULT_MINIMUM_BACKOFF_SECONDS = 10
DEFAULT_MAXIMUM_BACKOFF_SECONDS = 600
MAX_BACKOFF_SECONDS = 600
#: Expiration policy of a subscription: default ttl (when the policy is unset) and smallest ttl, in seconds.
DEFAULT_EXPIRATION_TTL_SECONDS = 31 * 24 * 3600
MIN_EXPIRATION_TTL_SECONDS = 24 * 3600
#: Labels on a resource: most labels, and the longest key and value in characters.
MAX_LABELS = 64
MAX_LABEL_CHARACTERS = 63
#: Dead-letter policy: default and range of max_delivery_attempts.
DEFAULT_MAX_DELIVERY_ATTEMPTS = 5
MIN_MAX_DELIVERY_ATTEMPTS = 5
MAX_MAX_DELIVERY_ATTEMPTS = 100
#: Paged lists: default and largest page size.
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
#: Name a subscription's topic takes after the topic is deleted.
DELETED_TOPIC = "_deleted-topic_"
#: Name a topic's schema_settings.schema takes after the schema is deleted.
DELETED_SCHEMA = "_deleted-schema_"
#: Largest schema definition, in bytes, and most revisions one schema keeps.
MAX_SCHEMA_DEFINITION_BYTES = 300_000
MAX_SCHEMA_REVISIONS = 20
#: Most schemas one project may hold (the real service's quota, "Pub/Sub quotas and limits").
MAX_SCHEMAS_PER_PROJECT = 10_000

_RESOURCE_ID = re.compile(r"[A-Za-z][A-Za-z0-9\-_.~+%]{2,254}")
_PROJECT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9\-_.:]{0,127}")


class ServiceError(Exception):
    """A request the service refuses: a status code and a message in the real service's words.

    ``details`` are protobuf messages (such as ``google.rpc.ErrorInfo``) sent with the status, in the
    ``grpc-status-details-bin`` trailer, for clients that read more than the code.
    """

    def __init__(self, code: StatusCode, message: str, details: Sequence[Any] = ()) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.details = tuple(details)


def invalid(message: str) -> ServiceError:
    """An INVALID_ARGUMENT error."""
    return ServiceError(StatusCode.INVALID_ARGUMENT, message)


def not_found(name: str) -> ServiceError:
    """The real service's NOT_FOUND for a topic or subscription, naming only the resource ID."""
    return ServiceError(StatusCode.NOT_FOUND, f"Resource not found (resource={name.rsplit('/', 1)[-1]}).")


def already_exists(name: str) -> ServiceError:
    """The real service's ALREADY_EXISTS for a topic or subscription."""
    return ServiceError(
        StatusCode.ALREADY_EXISTS,
        f"Resource already exists in the project (resource={name.rsplit('/', 1)[-1]}).",
    )


#: An ack ID that is unknown, expired or superseded by a later delivery: the client must not retry it.
PERMANENT_FAILURE_INVALID_ACK_ID = "PERMANENT_FAILURE_INVALID_ACK_ID"


def ack_id_failures(failures: Mapping[str, str]) -> ServiceError:
    """The real service's answer, with exactly-once delivery, to acks or modacks that did not all succeed:
    INVALID_ARGUMENT with an ``ErrorInfo`` whose metadata maps each failed ack ID to its failure
    (``PERMANENT_FAILURE_...`` or ``TRANSIENT_FAILURE_...``); the official clients read it per ack ID."""
    info = error_details_pb2.ErrorInfo(
        reason="EXACTLY_ONCE_ACKID_FAILURE", domain="pubsub.googleapis.com", metadata=dict(failures)
    )
    return ServiceError(
        StatusCode.INVALID_ARGUMENT,
        "Some acknowledgement ids in the request were invalid. This could be because the acknowledgement "
        "ids have expired or the acknowledgement ids were malformed.",
        details=(info,),
    )


def too_large(what: str, given: int, maximum: int) -> ServiceError:
    """The real service's wording for a value over its limit."""
    return invalid(
        f"The value for {what} is too large. You passed {given} in the request, "
        f"but the maximum value is {maximum}."
    )


def _invalid_name(name: str) -> ServiceError:
    return invalid(
        f"Invalid resource name given (name={name}). Refer to the Pub/Sub documentation on resource "
        "names: IDs are 3 to 255 characters, start with a letter, use only letters, digits and "
        "-_.~+%, and do not start with 'goog'."
    )


def check_project(name: str) -> str:
    """Check ``projects/{project}``; return the project ID."""
    parts = name.split("/")
    if len(parts) != 2 or parts[0] != "projects" or not _PROJECT_ID.fullmatch(parts[1]):
        raise invalid(f"Invalid project name given (name={name}); expected projects/{{project}}.")
    return parts[1]


def check_name(name: str, collection: str) -> str:
    """Check ``projects/{project}/{collection}/{id}`` (collection ``topics``, ``subscriptions``, ...)."""
    parts = name.split("/")
    if (
        len(parts) != 4
        or parts[0] != "projects"
        or parts[2] != collection
        or not _PROJECT_ID.fullmatch(parts[1])
        or not _RESOURCE_ID.fullmatch(parts[3])
        or parts[3][:4].lower() == "goog"
    ):
        raise _invalid_name(name)
    return name


def check_topic_name(name: str) -> str:
    """Check a topic's full name."""
    return check_name(name, "topics")


def check_subscription_name(name: str) -> str:
    """Check a subscription's full name."""
    return check_name(name, "subscriptions")


def check_ack_deadline(seconds: int, *, allow_zero: bool, field: str = "ack_deadline_seconds") -> int:
    """Check a subscription or stream ack deadline (10..600) or a modify deadline (0..600)."""
    low = 0 if allow_zero else MIN_ACK_DEADLINE_SECONDS
    if not low <= seconds <= MAX_ACK_DEADLINE_SECONDS:
        raise invalid(
            f"Invalid ack deadline given: {seconds} seconds. {field} must be between {low} and "
            f"{MAX_ACK_DEADLINE_SECONDS} seconds."
        )
    return seconds


def seconds(duration: Any) -> float:
    """A ``google.protobuf.Duration`` in seconds."""
    return duration.seconds + duration.nanos / 1e9


def _duration_words(value: float) -> str:
    return f"{value:g}s"


def check_retention(resource: Any) -> None:
    """A topic's or subscription's ``message_retention_duration``, when set: 10 minutes to 31 days."""
    if not resource.HasField("message_retention_duration"):
        return
    given = seconds(resource.message_retention_duration)
    if not MIN_RETENTION_SECONDS <= given <= MAX_RETENTION_SECONDS:
        raise invalid(
            f"Invalid message_retention_duration given: {_duration_words(given)}. It must be between "
            "10 minutes and 31 days."
        )


def check_retry_policy(subscription: Any) -> None:
    """A subscription's ``retry_policy``: each back-off 0-600 s and minimum <= maximum.

    A policy that leaves a back-off unset gets the real service's default for it (10 s and 600 s).
    """
    if not subscription.HasField("retry_policy"):
        return
    policy = subscription.retry_policy
    if not policy.HasField("minimum_backoff"):
        policy.minimum_backoff.seconds = DEFAULT_MINIMUM_BACKOFF_SECONDS
    if not policy.HasField("maximum_backoff"):
        policy.maximum_backoff.seconds = DEFAULT_MAXIMUM_BACKOFF_SECONDS
    minimum = seconds(policy.minimum_backoff)
    maximum = seconds(policy.maximum_backoff)
    for field, value in (("minimum_backoff", minimum), ("maximum_backoff", maximum)):
        if not 0 <= value <= MAX_BACKOFF_SECONDS:
            raise invalid(
                f"Invalid retry_policy.{field} given: {_duration_words(value)}. It must be between 0 and "
                f"{MAX_BACKOFF_SECONDS} seconds."
            )
    if minimum > maximum:
        raise invalid(
            f"Invalid retry_policy given: minimum_backoff ({_duration_words(minimum)}) must not be greater "
            f"than maximum_backoff ({_duration_words(maximum)})."
        )


def check_expiration_policy(subscription: Any) -> None:
    """A subscription's ``expiration_policy``: ttl at least 1 day.

    Unset, the policy becomes the default (ttl 31 days); set with no ttl, the subscription never expires.
    """
    if not subscription.HasField("expiration_policy"):
        subscription.expiration_policy.ttl.seconds = DEFAULT_EXPIRATION_TTL_SECONDS
        return
    policy = subscription.expiration_policy
    if not policy.HasField("ttl"):
        return
    ttl = seconds(policy.ttl)
    if ttl < MIN_EXPIRATION_TTL_SECONDS:
        raise invalid(
            f"Invalid expiration_policy.ttl given: {_duration_words(ttl)}. The minimum is 1 day (86400s); "
            "leave ttl unset for a subscription that never expires."
        )


def expiration_ttl(subscription: Any) -> float | None:
    """How long a subscription may stay inactive before it is deleted, in seconds; ``None``: never."""
    if not subscription.HasField("expiration_policy"):
        return float(DEFAULT_EXPIRATION_TTL_SECONDS)
    policy = subscription.expiration_policy
    return seconds(policy.ttl) if policy.HasField("ttl") else None


def _label_character(character: str) -> bool:
    # Lowercase letters (international ones too, and letters of scripts without case), digits, _ and -.
    return character in "_-" or character.isdigit() or (character.isalpha() and not character.isupper())


def check_labels(labels: Any) -> None:
    """Labels as the real service takes them: at most 64; keys 1-63 characters starting with a lowercase
    letter, values 0-63 characters; both only lowercase letters, digits, ``_`` and ``-``."""
    if len(labels) > MAX_LABELS:
        raise invalid(f"Invalid labels given: {len(labels)} labels; a resource has at most {MAX_LABELS}.")
    for key, value in labels.items():
        if (
            not 1 <= len(key) <= MAX_LABEL_CHARACTERS
            or not (key[0].isalpha() and not key[0].isupper())
            or not all(_label_character(character) for character in key)
        ):
            raise invalid(
                f"Invalid label key given (key={key}). Label keys are 1 to 63 characters, start with a "
                "lowercase letter, and use only lowercase letters, digits, underscores and dashes."
            )
        if len(value) > MAX_LABEL_CHARACTERS or not all(_label_character(character) for character in value):
            raise invalid(
                f"Invalid label value given (key={key}, value={value}). Label values are at most 63 "
                "characters of lowercase letters, digits, underscores and dashes."
            )


#: Fields each ingestion source needs, by the name of the source in ``IngestionDataSourceSettings``.
_INGESTION_REQUIRED: dict[str, tuple[str, ...]] = {
    "aws_kinesis": ("stream_arn", "consumer_arn", "aws_role_arn", "gcp_service_account"),
    "cloud_storage": ("bucket",),
    "azure_event_hubs": (
        "resource_group",
        "namespace",
        "event_hub",
        "client_id",
        "tenant_id",
        "subscription_id",
        "gcp_service_account",
    ),
    "aws_msk": ("cluster_arn", "topic", "aws_role_arn", "gcp_service_account"),
    "confluent_cloud": ("bootstrap_server", "cluster_id", "topic", "identity_pool_id", "gcp_service_account"),
}


def check_ingestion_settings(topic: Any) -> None:
    """A topic's ``ingestion_data_source_settings``: the chosen source has every field it needs."""
    if not topic.HasField("ingestion_data_source_settings"):
        return
    settings = topic.ingestion_data_source_settings
    source = settings.WhichOneof("source")
    if source is None:
        return
    body = getattr(settings, source)
    for field in _INGESTION_REQUIRED.get(source, ()):
        if not getattr(body, field):
            raise invalid(
                f"Invalid ingestion_data_source_settings given: {source}.{field} is required for "
                f"{source} ingestion."
            )
    if source == "cloud_storage" and body.WhichOneof("input_format") is None:
        raise invalid(
            "Invalid ingestion_data_source_settings given: cloud_storage needs an input format "
            "(text_format, avro_format or pubsub_avro_format)."
        )


def check_attribute_key(key: str) -> None:
    """Keys starting ``goog``, in any case (``GOOG``, ``Goog``), are the service's own, except
    ``googclient_``: the official clients add those themselves (``googclient_traceparent`` when tracing
    is on), and the service keeps them."""
    if key[:4].lower() == "goog" and not key.startswith("googclient_"):
        raise invalid(f"Attribute keys must not start with 'goog' (key={key}).")


def check_message(message: Any) -> None:
    """One message of a Publish request against the service's limits."""
    data_size = len(message.data)
    attributes = message.attributes
    if not data_size and not attributes:
        raise invalid(
            "One or more messages in the publish request is empty. Each message must contain either "
            "non-empty data, or at least one attribute."
        )
    if data_size > MAX_MESSAGE_DATA_BYTES:
        raise too_large("message_size", data_size, MAX_MESSAGE_DATA_BYTES)
    if attributes:
        if len(attributes) > MAX_ATTRIBUTES:
            raise too_large("attributes_count", len(attributes), MAX_ATTRIBUTES)
        for key, value in attributes.items():
            key_size = len(key.encode())
            if key_size > MAX_ATTRIBUTE_KEY_BYTES:
                raise too_large("attribute_key_size", key_size, MAX_ATTRIBUTE_KEY_BYTES)
            if not key_size:
                raise invalid("Attribute keys must not be empty.")
            value_size = len(value.encode())
            if value_size > MAX_ATTRIBUTE_VALUE_BYTES:
                raise too_large("attribute_value_size", value_size, MAX_ATTRIBUTE_VALUE_BYTES)
            check_attribute_key(key)
    key = message.ordering_key
    if key:
        key_size = len(key.encode())
        if key_size > MAX_ORDERING_KEY_BYTES:
            raise too_large("ordering_key_size", key_size, MAX_ORDERING_KEY_BYTES)
