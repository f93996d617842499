"""Load shedding of the gRPC face: calls wait rather than fail, up to a bound that a server cannot
outgrow; past it, the refusal is one every official client retries.

gRPC holds the calls that arrive faster than the event loop takes them up (up to ``MAX_PENDING_CALLS`` of
``hedgepub.server._local``, far above gRPC's default of 1,000, whose refusals were CANCELLED). Once taken
up, a call counts as in progress until it ends; a call taken up while :data:`MAX_CALLS_IN_PROGRESS` are
already in progress is answered UNAVAILABLE at once (HTTP 503 over REST), without running: the status
that the official clients retry with back-off for every Pub/Sub method (Publish also retries
RESOURCE_EXHAUSTED, ABORTED, CANCELLED, ...; Pull and StreamingPull retry UNAVAILABLE).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio

from hedgepub.server._api.handlers import as_async_iterator, behavior_of, rebuilt

#: Calls in progress at once past which a new call is answered UNAVAILABLE. Long enough for thousands of
#: waiting Pulls and StreamingPulls besides a burst of Publish calls.
MAX_CALLS_IN_PROGRESS = 50_000
#: Counting handlers kept: more than the services have methods.
_CACHED_HANDLERS = 256


class LoadShedder(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]  # generic in the stubs only
    """Counts the calls in progress and refuses, UNAVAILABLE, those past :data:`MAX_CALLS_IN_PROGRESS`."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self.in_progress = 0
        #: Calls refused so far.
        self.shed = 0
        #: The counting handler of each method's handler, made once: a method's handler is the same
        #: object for every call, and wrapping it anew per call cost a Publish several microseconds.
        self._wrapped: dict[int, tuple[grpc.RpcMethodHandler[Any, Any], grpc.RpcMethodHandler[Any, Any]]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        """The call's handler, counted while it runs (or one that refuses it)."""
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        known = self._wrapped.get(id(handler))
        if known is not None and known[0] is handler:
            return known[1]
        wrapped = self._counting(handler)
        if len(self._wrapped) >= _CACHED_HANDLERS:
            self._wrapped.clear()  # handlers made per call (a fault rule's) would otherwise pile up
        self._wrapped[id(handler)] = (handler, wrapped)
        return wrapped

    def _counting(self, handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
        """``handler`` counted while it runs, or refusing the call past the bound."""
        behavior = behavior_of(handler)
        shedder = self

        def admit() -> str | None:
            limit = MAX_CALLS_IN_PROGRESS if shedder.limit is None else shedder.limit
            if shedder.in_progress >= limit:
                shedder.shed += 1
                return f"The server is overloaded ({shedder.in_progress:,} calls in progress); retry later."
            shedder.in_progress += 1
            return None

        if handler.response_streaming and not inspect.iscoroutinefunction(behavior):

            async def streaming(
                request: Any, context: grpc.aio.ServicerContext[Any, Any]
            ) -> AsyncIterator[Any]:
                refusal = admit()
                if refusal is not None:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, refusal)
                try:
                    async for response in as_async_iterator(behavior(request, context)):
                        yield response
                finally:
                    shedder.in_progress -= 1

            return rebuilt(handler, streaming)

        # A unary answer, or a streaming one written with context.write() (the behavior returns nothing).
        async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            refusal = admit()
            if refusal is not None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, refusal)
            try:
                result = behavior(request, context)
                return await result if inspect.isawaitable(result) else result
            finally:
                shedder.in_progress -= 1

        return rebuilt(handler, unary)
