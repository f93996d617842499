"""hedgepub's own status codes, so that layers below the transport need no gRPC import.

The names and numbers are those of ``google.rpc.Code`` (and so of ``grpc.StatusCode``); the transport
maps between the two at one boundary.
"""

from __future__ import annotations

import enum


class StatusCode(enum.IntEnum):
    """A canonical RPC status code, as numbered by ``google.rpc.Code``."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


#: The codes the reference Pub/Sub publishers retry by default.
DEFAULT_RETRYABLE_CODES: frozenset[StatusCode] = frozenset(
    {
        StatusCode.ABORTED,
        StatusCode.CANCELLED,
        StatusCode.DEADLINE_EXCEEDED,
        StatusCode.INTERNAL,
        StatusCode.RESOURCE_EXHAUSTED,
        StatusCode.UNAVAILABLE,
        StatusCode.UNKNOWN,
    }
)
