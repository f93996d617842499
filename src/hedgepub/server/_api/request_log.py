"""The request log: one line per RPC at debug level on ``hedgepub.server.requests`` (``hedgepub -vv serve``),
naming the method, its status, its time and who made the call.

Off (the default), it costs the interceptor one level check per call, and no handler is wrapped for it.
"""

from __future__ import annotations

import logging

import grpc.aio

from hedgepub.server._front.front import REST_CLIENT_METADATA, client_peer

__all__ = ["REQUEST_LOG", "call_peer", "log_request"]

#: Every request is logged here at debug level.
REQUEST_LOG = logging.getLogger("hedgepub.server.requests")


def log_request(name: str, context: grpc.aio.ServicerContext, seconds: float) -> None:
    """Log the call of method ``name`` (short name) that took ``seconds``, with its status and peer."""
    code = context.code()
    status = "OK" if code is None else getattr(code, "name", str(code))
    REQUEST_LOG.debug("%s %s %.1f ms (peer %s)", name, status, seconds * 1e3, call_peer(context))


def call_peer(context: grpc.aio.ServicerContext) -> str:
    """Who made the call: a REST call's HTTP client, a relayed gRPC call's client, or the peer itself."""
    for key, value in context.invocation_metadata() or ():
        if key == REST_CLIENT_METADATA:
            return f"{value} over REST"
    return client_peer(context.peer())
