"""Topics and subscriptions as resources: names, field validation, update masks and list pages.

Pure functions over protobuf objects, in the real service's words; :class:`~.catalog.Catalog`
calls them before it writes anything to the store.
"""

from __future__ import annotations

import base64
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

from google.protobuf import duration_pb2, field_mask_pb2
from google.pubsub_v1.types import pubsub as pubsub_types

from hedgepub.server._pubsub import limits as limits
from hedgepub.server._pubsub.export_config import check_exports
from hedgepub.server._pubsub.filters import compile_filter
from hedgepub.server._pubsub.limits import check_message, invalid, not_found
from hedgepub.server._pubsub.oidc import valid_service_account_email
from hedgepub.server._pubsub.plain_publish import plain
from hedgepub.server._pubsub.transforms import check_transforms

Topic: Any = pubsub_types.Topic.pb()
Subscription: Any = pubsub_types.Subscription.pb()

TOPIC_UPDATABLE = frozenset(
    {
        "labels",
        "message_storage_policy",
        "kms_key_name",
        "schema_settings",
        "message_retention_duration",
        "ingestion_data_source_settings",
        "message_transforms",
    }
)
SUBSCRIPTION_UPDATABLE = frozenset(
    {
        "push_config",
        "bigquery_config",
        "cloud_storage_config",
        "ack_deadline_seconds",
        "retain_acked_messages",
        "message_retention_duration",
        "labels",
        "expiration_policy",
        "dead_letter_policy",
        "retry_policy",
        "enable_exactly_once_delivery",
        "message_transforms",
    }
)


_Found = TypeVar("_Found")


def existing(table: Mapping[str, _Found], name: str) -> _Found:
    """The topic or subscription called ``name`` (already checked), or NOT_FOUND."""
    found = table.get(name)
    if found is None:
        raise not_found(name)
    return found


def check_topic_fields(topic: Any) -> None:
    """The fields of a topic to create or update that the service checks."""
    limits.check_retention(topic)
    limits.check_labels(topic.labels)
    limits.check_ingestion_settings(topic)
    check_transforms(topic.message_transforms, run_code=False)  # the code: in the sandbox


#: Topic.State INGESTION_RESOURCE_ERROR.
TOPIC_INGESTION_RESOURCE_ERROR = 2


def topic_state(topic: Any) -> int:
    """A topic's output-only ``state``: an ingestion topic's is INGESTION_RESOURCE_ERROR (this server
    reaches no external source, so nothing is ingested); other topics' stays unspecified, as Google's
    emulator leaves it."""
    settings = topic.ingestion_data_source_settings
    if topic.HasField("ingestion_data_source_settings") and settings.WhichOneof("source") is not None:
        return TOPIC_INGESTION_RESOURCE_ERROR
    return 0


#: The attribute of ``push_config.attributes`` that names the push format's version; the service fills it
#: in on a push subscription (``v1``, the API's), and leaves it as it was when a change omits it.
PUSH_VERSION_ATTRIBUTE = "x-goog-version"
DEFAULT_PUSH_VERSION = "v1"


def check_subscription_fields(config: Any, previous: Any | None = None, *, buckets: bool = False) -> None:
    """Check a subscription to create or update (``previous``: as it is now), filling in the defaults the
    service fills in. ``buckets``: whether the server writes Cloud Storage subscriptions' files."""
    if config.ack_deadline_seconds == 0:
        config.ack_deadline_seconds = limits.DEFAULT_ACK_DEADLINE_SECONDS
    limits.check_ack_deadline(config.ack_deadline_seconds, allow_zero=False)
    if config.HasField("message_retention_duration"):
        limits.check_retention(config)
    else:
        config.message_retention_duration.CopyFrom(
            duration_pb2.Duration(seconds=limits.DEFAULT_RETENTION_SECONDS)
        )
    limits.check_labels(config.labels)
    limits.check_retry_policy(config)
    limits.check_expiration_policy(config)
    compile_filter(config.filter)  # INVALID_ARGUMENT, saying where, for one that does not parse
    check_push_config(config.push_config)
    attributes = config.push_config.attributes
    if config.push_config.push_endpoint and PUSH_VERSION_ATTRIBUTE not in attributes:
        kept = previous.push_config.attributes.get(PUSH_VERSION_ATTRIBUTE) if previous is not None else None
        attributes[PUSH_VERSION_ATTRIBUTE] = kept or DEFAULT_PUSH_VERSION
    if config.push_config.push_endpoint and config.enable_exactly_once_delivery:
        # The real service documents that only pull subscriptions support exactly-once delivery.
        raise invalid("Exactly-once delivery is not supported for push subscriptions.")
    check_transforms(config.message_transforms, run_code=False)  # the code: in the sandbox
    check_exports(config, buckets)
    if config.HasField("dead_letter_policy") and config.dead_letter_policy.dead_letter_topic:
        policy = config.dead_letter_policy
        limits.check_topic_name(policy.dead_letter_topic)
        if policy.max_delivery_attempts == 0:
            policy.max_delivery_attempts = limits.DEFAULT_MAX_DELIVERY_ATTEMPTS
        if (
            not limits.MIN_MAX_DELIVERY_ATTEMPTS
            <= policy.max_delivery_attempts
            <= limits.MAX_MAX_DELIVERY_ATTEMPTS
        ):
            raise invalid(
                f"Invalid max_delivery_attempts given: {policy.max_delivery_attempts}. It must be "
                f"between {limits.MIN_MAX_DELIVERY_ATTEMPTS} and {limits.MAX_MAX_DELIVERY_ATTEMPTS}."
            )
    elif config.HasField("dead_letter_policy"):
        config.ClearField("dead_letter_policy")


def check_push_config(push_config: Any) -> None:
    """A push endpoint, when there is one, is an absolute http or https URL; an OIDC token's service
    account has the form of an email address, and an audience comes with a service account."""
    oidc = push_config.oidc_token
    email = oidc.service_account_email
    if email and not valid_service_account_email(email):
        raise invalid(
            f"Invalid push_config.oidc_token.service_account_email ({email}): it must be the email "
            "address of a service account."
        )
    if oidc.audience and not email:
        raise invalid(
            "push_config.oidc_token.audience is set without push_config.oidc_token.service_account_email: "
            "the token is made for a service account, which must be given."
        )
    endpoint = push_config.push_endpoint
    if not endpoint:
        return
    try:
        parsed = urllib.parse.urlsplit(endpoint)
        valid = parsed.scheme in ("http", "https") and bool(parsed.hostname) and parsed.port != 0
    except ValueError:  # a port that is not a number, or out of range
        valid = False
    if not valid:
        raise invalid(
            f"Unsupported push_endpoint (push_endpoint={endpoint}): it must be an absolute http:// or "
            "https:// URL."
        )


def check_publish(messages: Any, request_bytes: int, request: Any = None) -> None:
    """A Publish request's messages: count, total size and each message (``request``: the
    ``PublishRequest`` whose ``messages`` these are, if any: when its messages carry data alone, which
    :func:`~.plain_publish.plain` tells in C, no message needs a look of its own)."""
    count = len(messages)
    if count == 0:
        raise invalid("The request contains no messages; a Publish request must contain at least one.")
    if count > limits.MAX_MESSAGES_PER_PUBLISH:
        raise limits.too_large("message_count", count, limits.MAX_MESSAGES_PER_PUBLISH)
    if request_bytes > limits.MAX_PUBLISH_REQUEST_BYTES:
        raise limits.too_large("request_size", request_bytes, limits.MAX_PUBLISH_REQUEST_BYTES)
    if request is not None:
        data_only, size = plain(request)
        # Data alone, not empty, and no longer than the request: check_message has nothing to refuse.
        if data_only and size <= limits.MAX_MESSAGE_DATA_BYTES:
            return
    for message in messages:
        check_message(message)


def page(names: list[str], page_size: int, page_token: str) -> tuple[list[str], str]:
    """One page of sorted ``names`` and the token of the next (empty when there is none)."""
    if page_size < 0:
        raise invalid(f"Invalid page_size given: {page_size}. It must not be negative.")
    size = min(page_size or limits.DEFAULT_PAGE_SIZE, limits.MAX_PAGE_SIZE)
    start = 0
    if page_token:
        try:
            after = base64.urlsafe_b64decode(page_token.encode("ascii")).decode("utf-8")
        except (ValueError, UnicodeError):
            raise invalid(f"Invalid page token given (page_token={page_token}).") from None
        if not after.startswith("after:"):
            raise invalid(f"Invalid page token given (page_token={page_token}).")
        after = after[len("after:") :]
        start = next((i for i, name in enumerate(names) if name > after), len(names))
    chosen = names[start : start + size]
    if start + size < len(names):
        token = base64.urlsafe_b64encode(f"after:{chosen[-1]}".encode()).decode("ascii")
        return chosen, token
    return chosen, ""


def project_page(
    project: str, collection: str, names: Iterable[str], page_size: int, page_token: str
) -> tuple[list[str], str]:
    """One page of the sorted names of ``project``'s topics or subscriptions (``collection``)."""
    limits.check_project(project)
    prefix = f"{project}/{collection}/"
    return page(sorted(name for name in names if name.startswith(prefix)), page_size, page_token)


def masked_update(
    kind: str, current: Any, update: Any, paths: Sequence[str], updatable: frozenset[str]
) -> Any:
    """A copy of ``current`` (a Topic or Subscription) with the fields of ``update`` named by the mask.

    The mask is checked in the real service's words: not empty, and naming only updatable fields.
    """
    request = f"Update{kind}Request"
    if not paths:
        raise invalid(f"The update_mask in the {request} must be set, and not empty.")
    for path in paths:
        if path.split(".", 1)[0] not in updatable:
            raise invalid(
                f"Invalid update_mask provided in the {request}: '{path}' is not a known {kind} field, or "
                "it cannot be updated. Note that field paths must be of the form 'push_config' rather than "
                "of the form 'pushConfig'."
            )
    updated = type(current)()
    updated.CopyFrom(current)
    _apply_mask(update, updated, paths)
    return updated


def _apply_mask(source: Any, destination: Any, paths: Sequence[str]) -> None:
    """Copy the masked fields from ``source`` to ``destination`` (a field absent in source is cleared)."""
    mask = field_mask_pb2.FieldMask(paths=list(paths))
    try:
        mask.MergeMessage(source, destination, replace_message_field=True, replace_repeated_field=True)
    except (ValueError, KeyError) as error:
        raise invalid(f"Invalid update_mask given: {error}") from None


def copy_with(config: Any, **changes: Any) -> Any:
    """A copy of a Topic or Subscription with some scalar fields changed."""
    updated = type(config)()
    updated.CopyFrom(config)
    for name, value in changes.items():
        setattr(updated, name, value)
    return updated
