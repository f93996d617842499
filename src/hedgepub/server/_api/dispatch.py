"""From the RPC table to gRPC handlers: parse the request, check its permission, call the servicer, and
turn what it raises into a status.

Every method of :data:`hedgepub.server._methods.RPCS` is served by the servicer's coroutine of the same
name; a request that cannot be parsed answers INVALID_ARGUMENT, a
:class:`~hedgepub.server._pubsub.limits.ServiceError` its status (with its details), a full disk
UNAVAILABLE, anything else INTERNAL (and the log). Unknown methods and services answer UNIMPLEMENTED
with a message naming the method.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import grpc
import grpc.aio
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError
from google.rpc import status_pb2

from hedgepub._status import StatusCode
from hedgepub.server._methods import RPCS, Rpc
from hedgepub.server._pubsub.limits import ServiceError
from hedgepub.server._store.datadir import DISK_FULL_MESSAGE, disk_full

__all__ = ["MALFORMED", "Servicer", "generic_handlers"]

logger = logging.getLogger("hedgepub.server")

#: What a request that cannot be parsed becomes (its handler answers INVALID_ARGUMENT).
MALFORMED = object()

_GRPC_CODES = {code.value[0]: code for code in grpc.StatusCode}


class Servicer(Protocol):
    """What the handlers call: a coroutine per RPC, named as the method, and the permission check."""

    async def authorize(self, method: str, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Raise a ServiceError unless the caller may call ``method`` with ``request``."""


def _grpc_code(code: StatusCode) -> grpc.StatusCode:
    return _GRPC_CODES[int(code)]


def _parser(message_class: Any) -> Callable[[bytes], Any]:
    parse = message_class.FromString

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError:
            return MALFORMED

    return deserialize


def _status_details(error: ServiceError) -> tuple[tuple[str, bytes], ...]:
    """The ``grpc-status-details-bin`` trailer carrying ``error.details`` (none when it has none)."""
    if not error.details:
        return ()
    packed = []
    for detail in error.details:
        holder = any_pb2.Any()
        holder.Pack(detail)
        packed.append(holder)
    status = status_pb2.Status(code=int(error.code), message=error.message, details=packed)
    return (("grpc-status-details-bin", status.SerializeToString()),)


async def _abort(context: grpc.aio.ServicerContext[Any, Any], method: str, error: Exception) -> None:
    """End a call that failed: a ServiceError's status and message, or INTERNAL (and the log) for a bug."""
    if isinstance(error, ServiceError):
        await context.abort(_grpc_code(error.code), error.message, _status_details(error))
    if disk_full(error):  # not a bug: the store refused a write, and recovers by itself when space returns
        logger.warning("%s: the disk is full (%s); answered UNAVAILABLE", method, error)
        await context.abort(grpc.StatusCode.UNAVAILABLE, DISK_FULL_MESSAGE)
    logger.error("%s failed", method, exc_info=error)
    await context.abort(grpc.StatusCode.INTERNAL, f"The server failed to handle {method}; see its log.")


def _unary(servicer: Servicer, rpc: Rpc) -> Callable[..., Awaitable[Any]]:
    method = rpc.name
    behavior = getattr(servicer, method)
    authorize = servicer.authorize
    name = rpc.request_class.DESCRIPTOR.name

    async def handle(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        if request is MALFORMED:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"The request could not be parsed as a {name}."
            )
        try:
            await authorize(method, request, context)
            return await behavior(request, context)
        except Exception as error:  # not CancelledError: a BaseException, it ends the call as it is
            await _abort(context, method, error)

    return handle


def _streaming(servicer: Servicer, rpc: Rpc) -> Callable[..., AsyncIterator[Any]]:
    method = rpc.name
    behavior = getattr(servicer, method)

    async def handle(
        requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        # The servicer authorizes with the first request, which only it reads.
        try:
            async for response in behavior(requests, context):
                yield response
        except Exception as error:  # not CancelledError: a BaseException, it ends the call as it is
            await _abort(context, method, error)

    return handle


class _Unimplemented(grpc.GenericRpcHandler):  # type: ignore[type-arg]  # generic in the stubs only
    """Answers any method nobody else serves with UNIMPLEMENTED and a message naming it."""

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any]:
        method = handler_call_details.method

        async def refuse(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED,
                f"Method {method} is not implemented by the hedgepub local Pub/Sub server.",
            )

        return grpc.stream_stream_rpc_method_handler(refuse)


def generic_handlers(servicer: Servicer) -> list[grpc.GenericRpcHandler[Any, Any]]:
    """The generic handlers of every RPC to add to a ``grpc.aio`` server, the UNIMPLEMENTED catch-all
    last. A method the servicer has no coroutine for falls through to the catch-all."""
    by_service: dict[str, dict[str, grpc.RpcMethodHandler[Any, Any]]] = {}
    for rpc in RPCS.values():
        if not hasattr(servicer, rpc.name):
            continue
        kind = grpc.stream_stream_rpc_method_handler if rpc.streaming else grpc.unary_unary_rpc_method_handler
        handler = kind(
            (_streaming if rpc.streaming else _unary)(servicer, rpc),
            request_deserializer=_parser(rpc.request_class),
            response_serializer=rpc.response_class.SerializeToString,
        )
        by_service.setdefault(rpc.service, {})[rpc.name] = handler
    handlers: list[grpc.GenericRpcHandler[Any, Any]] = [
        grpc.method_handlers_generic_handler(service, methods) for service, methods in by_service.items()
    ]
    handlers.append(_Unimplemented())
    return handlers
