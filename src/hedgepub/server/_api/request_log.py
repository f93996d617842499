"""The request log: one line per RPC at debug level on ``hedgepub.server.requests`` (``hedgepub -vv serve``),
naming the method, its status, its time, who made the call and, for a call that carries the
``x-goog-pubsub-client-telemetry`` header (a Publish attempt of Google's clients or hedgepub's), which
attempt it is: ``attempt 0`` for the original and its retries, ``attempt k`` for hedge k.

Off (the default), it costs the interceptor one level check per call, and no handler is wrapped for it.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc.aio

from hedgepub._wire import CLIENT_TELEMETRY_KEY, decode_client_telemetry
from hedgepub.server._front.front import REST_CLIENT_METADATA, client_peer

__all__ = ["REQUEST_LOG", "call_peer", "log_request"]

#: Every request is logged here at debug level.
REQUEST_LOG = logging.getLogger("hedgepub.server.requests")


def log_request(
    name: str, context: grpc.aio.ServicerContext[Any, Any], seconds: float, cancelled: bool = False
) -> None:
    """Log the call of method ``name`` (short name) that took ``seconds``, with its status and peer;
    ``cancelled``: its task was cancelled (the client cancelled, or its deadline passed)."""
    code = context.code()
    if cancelled or context.cancelled():
        # the client cancelled, or its deadline passed: nobody got an answer, whatever the handler did
        status = "CANCELLED by the client"
    else:
        status = "OK" if code is None else getattr(code, "name", str(code))
    attempt = ""
    for key, value in context.invocation_metadata() or ():
        if key == CLIENT_TELEMETRY_KEY:
            try:
                attempt = f", attempt {decode_client_telemetry(value)[0]}"
            except ValueError:
                attempt = ", attempt unknown (malformed client telemetry)"
    REQUEST_LOG.debug("%s %s %.1f ms (peer %s%s)", name, status, seconds * 1e3, call_peer(context), attempt)


def call_peer(context: grpc.aio.ServicerContext[Any, Any]) -> str:
    """Who made the call: a REST call's HTTP client, a relayed gRPC call's client, or the peer itself."""
    for key, value in context.invocation_metadata() or ():
        if key == REST_CLIENT_METADATA and isinstance(value, str):  # a text key: always str
            return f"{value} over REST"
    return client_peer(context.peer())
