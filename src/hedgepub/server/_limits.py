"""The real service's limits, resource-name rules and error messages, in one place.

Every check raises :class:`ServiceError` with the status code and wording of Google Cloud Pub/Sub, so that
the gRPC layer only has to translate it.
"""

from __future__ import annotations

import re

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
#: Message retention of a subscription: default and range, in seconds.
DEFAULT_RETENTION_SECONDS = 7 * 24 * 3600
MIN_RETENTION_SECONDS = 10 * 60
MAX_SUBSCRIPTION_RETENTION_SECONDS = 7 * 24 * 3600
MAX_TOPIC_RETENTION_SECONDS = 31 * 24 * 3600
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

_RESOURCE_ID = re.compile(r"[A-Za-z][A-Za-z0-9\-_.~+%]{2,254}")
_PROJECT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9\-_.:]{0,127}")


class ServiceError(Exception):
    """A request the service refuses: a status code and a message in the real service's words."""

    def __init__(self, code: StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


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
