"""The names the publisher and the local server share on the wire, and the client-telemetry header codec.

One module for every string both sides must spell the same way: the gRPC metadata keys of a Publish
attempt, the environment variable that points clients at an emulator, and the encoding of the
``x-goog-pubsub-client-telemetry`` header (docs/hedging.md, rule 8), which Google's clients put on their
Publish attempts so that the service can tell a hedge from an unrelated duplicate publish.

The header's value is the standard base64 (with padding; the key has no ``-bin`` suffix, so gRPC does not
encode it) of a serialized ``google.pubsub.v1.PubsubClientTelemetry`` whose ``publish_operation`` holds
``hedged_attempt_count`` (0 for the original attempt and its retries, k for hedge k) and
``publish_start_time`` (when the batch was first sent, the same on all its attempts)::

    encode_client_telemetry(0, None) == "CgA="
    encode_client_telemetry(1, None) == "CgIIAQ=="
"""

from __future__ import annotations

import base64
import binascii
import functools
import math
from typing import Any

#: The routing header every Google client sends: ``topic=<url-encoded topic name>``.
REQUEST_PARAMS_KEY = "x-goog-request-params"
#: hedgepub's own batch id, the same on every attempt of a batch: it names one batch exactly (the local
#: server's ``--dedup-hedges`` and request log use it), where two batches could share a start time.
BATCH_ID_KEY = "hedgepub-batch-id"
#: Google's client-telemetry header: which hedge an attempt is and when its batch was first sent.
CLIENT_TELEMETRY_KEY = "x-goog-pubsub-client-telemetry"
#: A caller's credentials: ``authorization: Bearer <token>``.
AUTHORIZATION_KEY = "authorization"

#: The environment variable every official client reads to find an emulator (``host:port``, plain text).
EMULATOR_HOST_ENV = "PUBSUB_EMULATOR_HOST"

_NANOS = 1_000_000_000


@functools.cache
def telemetry_class() -> Any:
    """The raw protobuf class of ``google.pubsub.v1.PubsubClientTelemetry`` (imported on first use, so
    that the CLI and the pytest plugin, which only need the names above, start without protobuf)."""
    from google.pubsub_v1.types import PubsubClientTelemetry

    return PubsubClientTelemetry.pb()


def encode_client_telemetry(hedged_attempt_count: int, publish_start_time: float | None) -> str:
    """The ``x-goog-pubsub-client-telemetry`` value of one Publish attempt.

    Args:
        hedged_attempt_count: 0 for the original attempt and its retries, k for hedge k.
        publish_start_time: when the batch was first sent, in seconds since the Unix epoch; ``None`` to
            leave it out.

    Raises:
        ValueError: a negative attempt count, or a start time that is not a finite number.
    """
    if isinstance(hedged_attempt_count, bool) or not isinstance(hedged_attempt_count, int):
        raise TypeError(f"hedged_attempt_count must be an int; got {type(hedged_attempt_count).__name__}")
    if not 0 <= hedged_attempt_count < 2**31:
        raise ValueError(f"hedged_attempt_count must be from 0 to 2**31 - 1; got {hedged_attempt_count}")
    telemetry = telemetry_class()()
    operation = telemetry.publish_operation
    operation.SetInParent()  # present even when empty: attempt 0 without a start time is "CgA="
    if hedged_attempt_count:
        operation.hedged_attempt_count = hedged_attempt_count
    if publish_start_time is not None:
        if not math.isfinite(publish_start_time):
            raise ValueError(f"publish_start_time must be a finite number; got {publish_start_time!r}")
        seconds = math.floor(publish_start_time)
        nanos = round((publish_start_time - seconds) * _NANOS)
        if nanos >= _NANOS:
            seconds, nanos = seconds + 1, nanos - _NANOS
        operation.publish_start_time.seconds = seconds
        operation.publish_start_time.nanos = nanos
    return base64.b64encode(telemetry.SerializeToString()).decode("ascii")


def decode_client_telemetry(value: str | bytes) -> tuple[int, float | None]:
    """``(hedged_attempt_count, publish_start_time or None)`` of an ``x-goog-pubsub-client-telemetry``
    value; the start time in seconds since the Unix epoch.

    Raises:
        ValueError: the value is not standard base64, not a serialized ``PubsubClientTelemetry``, carries
            no ``publish_operation``, or holds a negative attempt count or an out-of-range start time.
    """
    if isinstance(value, bytes):
        value = value.decode("ascii", errors="replace")
    if not isinstance(value, str):
        raise ValueError(f"the client telemetry header must be text; got {type(value).__name__}")
    try:
        raw = base64.b64decode(value.strip(), validate=True)
    except (binascii.Error, ValueError) as error:
        raise ValueError(f"the client telemetry header is not standard base64: {error}") from None
    from google.protobuf.message import DecodeError

    telemetry = telemetry_class()()
    try:
        telemetry.ParseFromString(raw)
    except DecodeError as error:
        raise ValueError(f"the client telemetry header is not a PubsubClientTelemetry: {error}") from None
    if not telemetry.HasField("publish_operation"):
        raise ValueError("the client telemetry header carries no publish_operation")
    operation = telemetry.publish_operation
    count = operation.hedged_attempt_count
    if count < 0:
        raise ValueError(f"the client telemetry header has a negative hedged_attempt_count ({count})")
    if not operation.HasField("publish_start_time"):
        return count, None
    start = operation.publish_start_time
    if not 0 <= start.nanos < _NANOS:
        raise ValueError(f"the client telemetry header's publish_start_time has nanos={start.nanos}")
    return count, start.seconds + start.nanos / _NANOS
