"""The proxy's one gRPC handler: every ``google.pubsub.v1`` RPC (and IAMPolicy's) forwarded upstream.

:class:`Forwarder` is a ``grpc.aio`` generic handler over the RPC table of :mod:`hedgepub._rpcs`:

- **unary RPCs** (admin calls, Pull, Acknowledge, ...) and **StreamingPull** go upstream as bytes: no
  request or response is parsed, a stream's messages are relayed one at a time each way (gRPC's flow
  control bounds what waits in the proxy);
- **Publish** is parsed for its topic, message count and ordering keys only, and its bytes go, unchanged,
  through the publisher core's hedging and retry path
  (:meth:`~hedgepub._publisher.forwarding.CoreForwarding.forward`) within the caller's deadline: the
  topic's token bucket, the hedge delay, hedge endpoints, the connection pool, the telemetry header; a
  request with an ordering key is never hedged. A request that does not parse, or has no topic or no
  message, goes upstream as it is, for the service's own answer.

The caller's metadata goes along, less what is the connection's or gRPC's own (pseudo headers, ``grpc-*``,
``user-agent``, ``content-type``, ``te``, ``host``) and, for Publish, the routing, telemetry and batch-id
headers that the core sets on every attempt itself. A caller's ``authorization`` goes through as it is;
without one, the proxy's own credentials (if it has any: Application Default Credentials in front of
Google) are added. The upstream's status, message and trailers (``grpc-status-details-bin`` with its
``ErrorInfo`` and the rest) come back unchanged.

Bytes of requests in flight are bounded (:class:`InFlightBytes`): one that would pass the bound is
answered ``RESOURCE_EXHAUSTED`` at once. A method outside the table is ``UNIMPLEMENTED`` (gRPC's own
answer when no handler takes it). Each call is logged at debug level on ``hedgepub.proxy.requests``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import grpc
import grpc.aio
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

from hedgepub._exceptions import PublishError, PublishTimeoutError, RpcError
from hedgepub._hedging.engine import BatchOutcome
from hedgepub._publisher.batch import request_overhead
from hedgepub._publisher.forwarding import CoreForwarding
from hedgepub._rpcs import RPCS
from hedgepub._transport.grpc import AuthHeaders, PublishResponsePb
from hedgepub._wire import AUTHORIZATION_KEY, BATCH_ID_KEY, CLIENT_TELEMETRY_KEY, REQUEST_PARAMS_KEY

__all__ = ["REQUEST_LOG", "Forwarder", "InFlightBytes", "forwarded_metadata", "publish_head"]

#: Every forwarded call is logged here at debug level (``hedgepub -vv proxy``).
REQUEST_LOG = logging.getLogger("hedgepub.proxy.requests")

PUBLISH = "Publish"
#: Metadata the connection or gRPC sets for each hop (besides pseudo headers and ``grpc-*``).
_HOP_HEADERS = frozenset({"user-agent", "content-type", "te", "host"})
#: For Publish, also what the core sets on every attempt: routing, client telemetry, batch id.
_CORE_HEADERS = _HOP_HEADERS | {REQUEST_PARAMS_KEY, CLIENT_TELEMETRY_KEY, BATCH_ID_KEY}
#: The one ``grpc-`` trailer that is the application's: the ``google.rpc.Status`` with its details.
STATUS_DETAILS_KEY = "grpc-status-details-bin"

MetadataPairs = list[tuple[str, Any]]


def forwarded_metadata(metadata: Iterable[Any] | None, *, publish: bool = False) -> MetadataPairs:
    """The caller's metadata as it goes upstream: without pseudo headers, ``grpc-*`` and the hop's own
    headers, and for Publish (``publish``) without the headers the core sets itself."""
    dropped = _CORE_HEADERS if publish else _HOP_HEADERS
    return [
        (key, value)
        for key, value in metadata or ()
        if not (key.startswith((":", "grpc-")) or key in dropped)
    ]


def returned_trailers(metadata: Iterable[Any] | None) -> MetadataPairs:
    """The upstream's trailers as they go back to the caller: all the application's, the status details
    (``grpc-status-details-bin``) included; gRPC's own (``grpc-status``, ``grpc-message``) are gRPC's."""
    return [
        (key, value)
        for key, value in metadata or ()
        if key == STATUS_DETAILS_KEY or not key.startswith((":", "grpc-"))
    ]


def _publish_head_class() -> Any:
    """A message class that reads of a ``PublishRequest`` only its topic and its messages' ordering keys:
    ``PublishHead {string topic = 1; repeated MessageHead messages = 2;}``, ``MessageHead {string
    ordering_key = 5;}`` (the field numbers of ``google.pubsub.v1``). Parsing a request with it, in C,
    skips the data and attributes; a full parse of a request of 100 messages took three times as long."""
    file = descriptor_pb2.FileDescriptorProto(
        name="hedgepub/proxy/publish_head.proto", package="hedgepub.proxy", syntax="proto3"
    )
    message = file.message_type.add(name="MessageHead")
    message.field.add(name="ordering_key", number=5, type=_STRING, label=_OPTIONAL)
    head = file.message_type.add(name="PublishHead")
    head.field.add(name="topic", number=1, type=_STRING, label=_OPTIONAL)
    head.field.add(
        name="messages", number=2, type=_MESSAGE, label=_REPEATED, type_name=".hedgepub.proxy.MessageHead"
    )
    pool = descriptor_pool.DescriptorPool()  # a pool of its own: nothing else sees these names
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("hedgepub.proxy.PublishHead"))


_STRING = descriptor_pb2.FieldDescriptorProto.TYPE_STRING
_MESSAGE = descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE
_OPTIONAL = descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL
_REPEATED = descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED
_PublishHead = _publish_head_class()


def publish_head(request: bytes) -> tuple[str, str, int] | None:
    """(topic, an ordering key of its messages or ``""``, message count) of a serialized
    ``PublishRequest``; ``None`` when it does not parse or has no topic or no message (the service
    answers those itself)."""
    try:
        head = _PublishHead.FromString(request)
    except (DecodeError, ValueError):
        return None
    messages = head.messages
    count = len(messages)
    if not head.topic or not count:
        return None
    head.DiscardUnknownFields()
    # Without keys, each message is an empty MessageHead: two bytes (tag, zero length) after the topic.
    if head.ByteSize() == request_overhead(head.topic) + 2 * count:
        return head.topic, "", count
    key = next(message.ordering_key for message in messages if message.ordering_key)
    return head.topic, key, count


class InFlightBytes:
    """The bytes of requests being forwarded, bounded: :meth:`admit` refuses one that would pass it."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"the in-flight bytes bound must be at least 1; got {limit!r}")
        self.limit = limit
        self.bytes = 0
        #: Requests refused so far.
        self.refused = 0

    def admit(self, size: int) -> bool:
        """Count ``size`` bytes in, or refuse them (False) when the bound would be passed."""
        if self.bytes + size > self.limit:
            self.refused += 1
            return False
        self.bytes += size
        return True

    def release(self, size: int) -> None:
        """The request of ``size`` bytes has its answer."""
        self.bytes -= size


def _grpc_code(error: PublishError) -> grpc.StatusCode:
    """The gRPC status of a publish failure that did not come from the upstream as it is."""
    if isinstance(error, PublishTimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    code = getattr(error, "code", None)
    if code is not None:
        for member in grpc.StatusCode:
            if member.value[0] == int(code):
                return member
    # A failure with no status (the upstream answered with the wrong number of IDs, an internal error).
    return grpc.StatusCode.UNKNOWN


class Forwarder(grpc.GenericRpcHandler):  # type: ignore[type-arg]  # generic in the stubs only
    """Serves every RPC of the table by forwarding it upstream (see the module's docstring).

    ``channel`` carries the calls that go as bytes; ``core`` hedges Publish; ``auth`` gives the proxy's
    own authorization headers for a service's full name (``None``: the proxy has no credentials).
    """

    def __init__(
        self,
        channel: grpc.aio.Channel,
        core: CoreForwarding,
        in_flight: InFlightBytes,
        auth: Callable[[str], AuthHeaders | None] = lambda service: None,
    ) -> None:
        self._channel = channel
        self._core = core
        self.in_flight = in_flight
        self._auth = auth
        self._auth_by_service: dict[str, AuthHeaders | None] = {}
        self._handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
        for rpc in RPCS.values():
            path = rpc.path
            if rpc.streaming:
                stream = channel.stream_stream(path, None, None)  # bytes both ways
                relay = self._streaming(rpc.name, stream)
                self._handlers[path] = grpc.stream_stream_rpc_method_handler(relay)
            elif rpc.name == PUBLISH:
                self._handlers[path] = grpc.unary_unary_rpc_method_handler(
                    self._publishing(channel.unary_unary(path, None, None))
                )
            else:
                call = channel.unary_unary(path, None, None)
                self._handlers[path] = grpc.unary_unary_rpc_method_handler(self._unary(rpc.name, call))

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        """The handler of the called method; ``None`` (UNIMPLEMENTED) for a method outside the table."""
        return self._handlers.get(handler_call_details.method)

    # ---- metadata both ways ----------------------------------------------------------------------------

    async def _upstream_metadata(
        self, service: str, context: grpc.aio.ServicerContext[Any, Any], *, publish: bool = False
    ) -> MetadataPairs:
        """The caller's metadata for upstream, with the proxy's authorization if the caller sent none
        (for Publish, the core's channels add it themselves). Raises :class:`_Failure` when the proxy's
        token cannot be had."""
        metadata = forwarded_metadata(context.invocation_metadata(), publish=publish)
        if publish or any(key == AUTHORIZATION_KEY for key, _ in metadata):
            return metadata
        if service not in self._auth_by_service:
            self._auth_by_service[service] = self._auth(service)
        auth = self._auth_by_service[service]
        if auth is not None:
            try:
                metadata += (await auth.fresh()).items()
            except RpcError as error:  # the token cannot be had: the caller learns why
                raise _Failure(_grpc_code(error), error.message) from error
        return metadata

    # ---- the three kinds of call -----------------------------------------------------------------------
    # Each ends with the caller's answer only after its bytes are released and its line is logged:
    # ``context.abort`` sends the status before it raises, and a caller may act on it at once.

    def _unary(self, name: str, call: grpc.aio.UnaryUnaryMultiCallable[Any, Any]) -> Callable[..., Any]:
        service = RPCS[name].service
        in_flight = self.in_flight

        async def forward(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
            started = time.perf_counter()
            size = len(request)
            if not in_flight.admit(size):
                _log(name, context, started, "RESOURCE_EXHAUSTED")
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, _refusal(in_flight))
            failure: _Failure | None = None
            try:
                metadata = await self._upstream_metadata(service, context)
                upstream = call(request, metadata=metadata, timeout=context.time_remaining())
                response: bytes = await upstream
                await _pass_trailers(upstream, context)
            except (grpc.aio.AioRpcError, _Failure) as error:
                failure = _Failure.of(error)
            finally:
                in_flight.release(size)
                _log(name, context, started, "OK" if failure is None else failure.code.name)
            if failure is not None:
                await failure.answer(context)
            return response

        return forward

    def _publishing(self, passthrough: grpc.aio.UnaryUnaryMultiCallable[Any, Any]) -> Callable[..., Any]:
        as_is = self._unary(PUBLISH, passthrough)
        in_flight = self.in_flight
        core = self._core

        async def publish(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
            head = publish_head(request)
            if head is None:  # no topic, no message, or not a PublishRequest: the service's own answer
                return await as_is(request, context)
            topic, key, count = head
            started = time.perf_counter()
            size = len(request)
            if not in_flight.admit(size):
                _log(PUBLISH, context, started, "RESOURCE_EXHAUSTED")
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, _refusal(in_flight))
            outcome: BatchOutcome | None = None
            failure: _Failure | None = None
            try:
                metadata = await self._upstream_metadata("", context, publish=True)
                timeout = context.time_remaining()
                outcome = await core.forward(topic, key, request, count, metadata, timeout)
                if outcome.error is not None:
                    failure = _Failure.of_publish(outcome.error)
            except RuntimeError as refused:  # the proxy is shutting down
                failure = _Failure(grpc.StatusCode.UNAVAILABLE, f"hedgepub proxy: {refused}")
            finally:
                in_flight.release(size)
                status = "CANCELLED" if outcome is None and failure is None else "OK"
                _log(PUBLISH, context, started, status if failure is None else failure.code.name, outcome)
            if failure is not None:
                await failure.answer(context)
            assert outcome is not None and outcome.message_ids is not None
            return bytes(PublishResponsePb(message_ids=outcome.message_ids).SerializeToString())

        return publish

    def _streaming(self, name: str, call: grpc.aio.StreamStreamMultiCallable[Any, Any]) -> Callable[..., Any]:
        service = RPCS[name].service

        async def relay(
            requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[bytes]:
            started = time.perf_counter()
            failure: _Failure | None = None
            upstream = None
            try:
                metadata = await self._upstream_metadata(service, context)
                upstream = call(requests, metadata=metadata, timeout=context.time_remaining())
                async for response in upstream:
                    yield response
                await _pass_trailers(upstream, context)
            except (grpc.aio.AioRpcError, _Failure) as error:
                failure = _Failure.of(error)
            finally:
                if upstream is not None:
                    upstream.cancel()  # the caller went away (or the stream ended): so does upstream's
                _log(name, context, started, "OK" if failure is None else failure.code.name)
            if failure is not None:
                await failure.answer(context)

        return relay


class _Failure(Exception):
    """How a forwarded call fails: the status, message and trailers its caller gets."""

    def __init__(self, code: grpc.StatusCode, details: str, trailers: MetadataPairs | None = None) -> None:
        super().__init__(code, details)
        self.code = code
        self.details = details
        self.trailers = tuple(trailers or ())

    @classmethod
    def of(cls, error: grpc.aio.AioRpcError | _Failure) -> _Failure:
        """The upstream's own answer, as it came (status, message, trailers); a failure as it is."""
        if isinstance(error, _Failure):
            return error
        return cls(error.code(), error.details() or "", returned_trailers(error.trailing_metadata()))

    @classmethod
    def of_publish(cls, error: PublishError) -> _Failure:
        """A forwarded Publish's failure: the upstream's last answer as it came, or (the caller's
        deadline passed, the token could not be had) the status of hedgepub's error."""
        upstream = getattr(error, "response", None)
        if isinstance(error, RpcError) and isinstance(upstream, grpc.aio.AioRpcError):
            return cls.of(upstream)
        return cls(_grpc_code(error), getattr(error, "message", None) or str(error))

    async def answer(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """End the call with this status (raises, as ``context.abort`` does)."""
        await context.abort(self.code, self.details, self.trailers)


async def _pass_trailers(upstream: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    """Give the caller the trailers of the upstream call that ended well (``upstream``, a grpc.aio call)."""
    trailers = returned_trailers(await upstream.trailing_metadata())
    if trailers:
        context.set_trailing_metadata(tuple(trailers))


def _refusal(in_flight: InFlightBytes) -> str:
    return (
        f"hedgepub proxy: {in_flight.bytes} bytes of requests are in flight, at the bound of "
        f"{in_flight.limit} (--max-in-flight-bytes); retry later"
    )


def _log(
    name: str,
    context: grpc.aio.ServicerContext[Any, Any],
    started: float,
    status: str,
    outcome: BatchOutcome | None = None,
) -> None:
    if not REQUEST_LOG.isEnabledFor(logging.DEBUG):
        return
    if context.cancelled():
        status = "CANCELLED by the client"
    hedging = ""
    if outcome is not None:
        won = ", a hedge won" if outcome.hedge_won else ""
        hedging = f", {outcome.attempts_sent} attempt{'s' if outcome.attempts_sent != 1 else ''}{won}"
    REQUEST_LOG.debug(
        "%s %s %.1f ms (peer %s%s)",
        name,
        status,
        (time.perf_counter() - started) * 1e3,
        context.peer(),
        hedging,
    )
