"""gRPC method handlers as values: taking one apart, building its like around another behavior, and the
handler of a method the server does not implement.

The fault injector (:mod:`hedgepub.server._faults.injector`) wraps each handler it touches in a coroutine
of its own; these are the pieces it needs to do that for all four kinds of handler (unary or streaming,
in each direction).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import grpc
import grpc.aio

from hedgepub.server._methods import STREAMING

__all__ = ["as_async_iterator", "behavior_of", "rebuilt", "unimplemented_handler"]


# The gRPC handler constructors by (request_streaming, response_streaming).
_HANDLER_FACTORIES: Mapping[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler[Any, Any]]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def behavior_of(handler: grpc.RpcMethodHandler[Any, Any]) -> Callable[..., Any]:
    """The function a handler calls: the one of its four that fits its streaming kinds."""
    # The one of the four that fits is set (the stubs type each as optional).
    function = (
        (handler.stream_stream if handler.response_streaming else handler.stream_unary)
        if handler.request_streaming
        else (handler.unary_stream if handler.response_streaming else handler.unary_unary)
    )
    assert function is not None
    return function


def rebuilt(
    handler: grpc.RpcMethodHandler[Any, Any], behavior: Callable[..., Any]
) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same streaming kinds and (de)serializers as ``handler`` that calls ``behavior``."""
    factory = _HANDLER_FACTORIES[(handler.request_streaming, handler.response_streaming)]
    return factory(
        behavior,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


async def as_async_iterator(responses: Any) -> AsyncIterator[Any]:
    """A streaming behavior's result (an iterator, async or not, an awaitable of one, or None), async."""
    if inspect.isawaitable(responses):
        responses = await responses
    if responses is None:
        return
    if hasattr(responses, "__aiter__"):
        async for response in responses:
            yield response
    else:
        for response in responses:
            yield response


def unimplemented_handler(name: str) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler that answers the method ``name`` (short name) with UNIMPLEMENTED."""

    async def unimplemented(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {name} is not implemented")

    if name in STREAMING:

        async def unimplemented_stream(
            request_iterator: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {name} is not implemented")

        return grpc.stream_stream_rpc_method_handler(unimplemented_stream)
    return grpc.unary_unary_rpc_method_handler(unimplemented)
