"""The REST face of the server: ``/v1/...`` HTTP/1.1 + JSON, answered by the gRPC face.

The routes are not written here: :func:`~.rest_routes.routes` reads them from the REST transports that
the installed ``google-cloud-pubsub`` package generates from the protos' ``google.api.http`` rules
(:mod:`.rest_routes`, with the transcoding). This module serves them: the HTTP/1.1 server, its limits
and time-outs, and :class:`RestGateway`, which calls the gRPC face.

A REST call is transcoded to the gRPC request (path variables, query parameters and the JSON body, in
the proto3 JSON mapping) and sent to the server's own gRPC port over an in-process channel, so it meets
the same interceptor (fault injection, request logging), IAM check (``authorization`` is passed on as
metadata), handlers and error mapping as a gRPC call: the two faces cannot drift apart. A gRPC status
comes back as Google's JSON error, ``{"error": {"code": 404, "message": ..., "status": "NOT_FOUND"}}``,
with the HTTP status the real service gives that code, and the status's details (the
``google.rpc.Status`` of the ``grpc-status-details-bin`` trailer, such as the ``ErrorInfo`` of an
exactly-once acknowledgement) as ``"details"``, each ``google.protobuf.Any`` in the proto3 JSON mapping.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import grpc
import grpc.aio
from aiohttp import ClientPayloadError

from hedgepub._status import StatusCode
from hedgepub.server._api import transforms_rest
from hedgepub.server._api.rest_routes import (
    RestError,
    Route,
    RouteTable,
    build_request,
    error_body,
    http_status,
    routes,
    status_details,
    to_json,
)
from hedgepub.server._front.front import REST_CLIENT_METADATA, peer_name
from hedgepub.server._iam.iam import PERMISSION_DENIED_MESSAGE, AllowAll, Authorizer
from hedgepub.server._pubsub.limits import ServiceError
from hedgepub.server._pubsub.transforms import Transforms

logger = logging.getLogger("hedgepub.server")


#: Largest REST request body: a 10 MB Publish, base64-encoded, plus the JSON around it.
MAX_BODY_BYTES = 20 * 1024 * 1024

#: Longest ``X-Server-Timeout`` taken as given; a longer one is cut to this (no call lasts as long).
MAX_SERVER_TIMEOUT_SECONDS = 24 * 3600.0
#: Request bodies held at once (read, parsed and being answered), in bytes as their Content-Length states
#: (a body of unstated length counts as MAX_BODY_BYTES); bodies under SMALL_BODY_BYTES are not counted.
#: Each byte of a JSON body costs about six in memory while its call is answered (the text, the parsed
#: JSON, the decoded data, the request message and its gRPC copies).
REST_BODY_BUDGET_BYTES = 3 * MAX_BODY_BYTES
SMALL_BODY_BYTES = 64 * 1024
#: How long a client may take to send a request's body once its head is in, before a 408 answer.
BODY_TIMEOUT_SECONDS = 60.0
#: How long a client may take to send a request's head (from its first byte), before the connection is
#: closed; and how long an idle kept-alive connection stays open.
HEAD_TIMEOUT_SECONDS = 30.0
KEEPALIVE_TIMEOUT_SECONDS = 75.0


class RestGateway:
    """Answers REST calls by calling the server's gRPC face at ``grpc_target`` (``host:port``)."""

    def __init__(
        self,
        grpc_target: str,
        options: Iterable[tuple[str, Any]] = (),
        authorizer: Authorizer | None = None,
        transforms: Transforms | None = None,
    ) -> None:
        self._channel = grpc.aio.insecure_channel(grpc_target, options=tuple(options))
        #: The server's transforms (its sandbox), which the two transforms methods run.
        self._transforms = transforms if transforms is not None else Transforms()
        #: The server's authorizer, for the two transforms methods (which have no gRPC method to call);
        #: ``None`` when IAM is not enforced.
        self._authorizer = None if isinstance(authorizer, AllowAll) else authorizer
        self._table = RouteTable(routes())
        self._callables: dict[str, grpc.aio.UnaryUnaryMultiCallable[Any, Any]] = {}

    async def close(self) -> None:
        """Close the channel to the gRPC face."""
        await self._channel.close(None)  # no grace: calls still running are cancelled

    def _callable(self, route: Route) -> grpc.aio.UnaryUnaryMultiCallable[Any, Any]:
        found = self._callables.get(route.grpc_method)
        if found is None:
            found = self._callables[route.grpc_method] = self._channel.unary_unary(
                route.grpc_method,
                request_serializer=route.request_class.SerializeToString,
                response_deserializer=route.response_class.FromString,
            )
        return found

    async def call(
        self,
        http_method: str,
        raw_path: str,
        query: Iterable[tuple[str, str]],
        body: bytes,
        headers: Mapping[str, str],
        client: str | None = None,
    ) -> tuple[int, bytes]:
        """One REST call: its HTTP status and JSON body (a response, or Google's JSON error).

        ``client`` (the HTTP client's address) goes along as metadata, for the request log.
        """
        transform_call = transforms_rest.match(http_method, raw_path)
        if transform_call is not None:
            return await self._transform_call(*transform_call, body, headers, client)
        try:
            route, path_values = self._table.match(http_method, raw_path)
            request = build_request(route, path_values, query, body)
            metadata = _call_metadata(headers, client)
            timeout = _server_timeout(headers.get("x-server-timeout"))
            response = await self._callable(route)(request, metadata=metadata, timeout=timeout)
        except RestError as error:
            return http_status(error.code), _error_json(error.code, error.message)
        except grpc.aio.AioRpcError as error:
            # grpc-stubs types AioRpcError's trailing metadata as objects; they are (key, value) pairs.
            details = status_details(error.trailing_metadata())  # type: ignore[arg-type]
            return http_status(error.code()), _error_json(error.code(), error.details() or "", details)
        return 200, to_json(response)

    async def _transform_call(
        self, project: str, method: str, body: bytes, headers: Mapping[str, str], client: str | None
    ) -> tuple[int, bytes]:
        """``validateMessageTransform`` and ``testMessageTransforms`` (see :mod:`.transforms_rest`): the
        caller authenticated as for any route; a topic or subscription whose transforms are tested is
        read through the gRPC face (so GetTopic's or GetSubscription's permission applies)."""
        authorizer = self._authorizer
        try:
            metadata = _call_metadata(headers, client)
            authenticate = getattr(authorizer, "authenticate", None)
            if authenticate is not None:
                authenticate(metadata)  # who the caller is, before anything is read or run
        except RestError as error:
            return http_status(error.code), _error_json(error.code, error.message)
        except ServiceError as error:
            code = grpc.StatusCode[error.code.name]
            return http_status(code), _error_json(code, error.message)

        async def authorize() -> None:
            if authorizer is not None and not await authorizer.granted(
                metadata, project, transforms_rest.TRANSFORM_PERMISSIONS
            ):
                raise ServiceError(StatusCode.PERMISSION_DENIED, PERMISSION_DENIED_MESSAGE)

        async def fetch(kind: str, name: str) -> Any:
            method_name = "GetTopic" if kind == "topic" else "GetSubscription"
            route = next(route for route in self._table.routes() if route.name == method_name)
            request = route.request_class(**{kind: name})
            return await self._callable(route)(request, metadata=metadata)

        try:
            code, payload = await transforms_rest.answer(
                method, body, fetch, self._transforms, authorize=authorize
            )
        except grpc.aio.AioRpcError as error:
            # grpc-stubs types AioRpcError's trailing metadata as objects; they are (key, value) pairs.
            details = status_details(error.trailing_metadata())  # type: ignore[arg-type]
            return http_status(error.code()), _error_json(error.code(), error.details() or "", details)
        if code != grpc.StatusCode.OK:
            return http_status(code), _error_json(code, str(payload))
        return 200, json.dumps(payload, indent=2).encode()


def _call_metadata(headers: Mapping[str, str], client: str | None) -> tuple[tuple[str, str], ...]:
    """The gRPC metadata of a REST call: its Authorization header, and the client's address for the log."""
    metadata: list[tuple[str, str]] = []
    authorization = headers.get("authorization")
    if authorization:
        if not authorization.isascii() or not authorization.isprintable():
            # gRPC metadata carries printable ASCII only: such a header can hold no valid token.
            raise RestError(
                grpc.StatusCode.UNAUTHENTICATED,
                "Request had invalid authentication credentials: the Authorization header is not "
                "printable ASCII.",
            )
        metadata.append(("authorization", authorization))
    if client:
        metadata.append((REST_CLIENT_METADATA, client))
    return tuple(metadata)


def _server_timeout(header: str | None) -> float | None:
    """The call's deadline in seconds from ``X-Server-Timeout`` (which gcloud sends), as Google's front
    end reads it; None when absent or not a positive number."""
    if not header:
        return None
    try:
        seconds = float(header)
    except ValueError:
        return None
    if not (math.isfinite(seconds) and seconds > 0):
        return None
    # gRPC keeps a deadline in 64-bit nanoseconds: a larger one (1e300) overflows into one already past.
    return min(seconds, MAX_SERVER_TIMEOUT_SECONDS)


def _error_json(code: grpc.StatusCode, message: str, details: Iterable[dict[str, Any]] = ()) -> bytes:
    return json.dumps(error_body(code, message, details), indent=2).encode()


def http_protocol_factory(
    gateway: RestGateway, pages: Mapping[str, Callable[[], Awaitable[Any]]] | None = None
) -> Any:
    """aiohttp's low-level HTTP/1.1 server answering every request through ``gateway``.

    ``pages``: paths outside the API answered to GET with a JSON document, each made by its coroutine
    function (the push tokens' public keys, see ``_oidc.py``). The returned object makes one protocol
    per connection (call it with no argument); its ``shutdown`` coroutine closes them all.
    """
    from aiohttp import web

    documents = dict(pages or {})
    budget = ByteBudget(REST_BODY_BUDGET_BYTES)

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        try:
            return await answer(request)
        finally:
            if isinstance(request.protocol, _RestProtocol):
                request.protocol.request_done()

    async def answer(request: web.BaseRequest) -> web.StreamResponse:
        raw_path = request.rel_url.raw_path
        if raw_path == "/" and request.method in ("GET", "HEAD"):
            # What the Google emulator answers too; scripts poll it to learn the server is up.
            return web.Response(text="Ok\n")
        page = documents.get(request.rel_url.path)
        if page is not None and request.method in ("GET", "HEAD"):
            try:
                return web.json_response(await page())
            except Exception:
                logger.exception("GET %s failed", raw_path)
                message = f"The server failed to make {raw_path}; see its log."
                return web.json_response(error_body(grpc.StatusCode.INTERNAL, message), status=500)
        if (request.content_length or 0) > MAX_BODY_BYTES:
            # Refused by its declared length, before any of it is read (or asked for, below).
            return _too_large()
        # Large bodies in memory at once are bounded in bytes: past the budget a request waits here, its
        # body unread (and, with Expect: 100-continue, not yet asked for), until earlier ones are answered.
        weight = budget.weight(request.content_length)
        await budget.acquire(weight)
        try:
            return await answer_with_body(request, raw_path)
        finally:
            budget.release(weight)

    async def answer_with_body(request: web.BaseRequest, raw_path: str) -> web.StreamResponse:
        if request.version >= (1, 1) and request.headers.get("expect", "").lower() == "100-continue":
            # curl asks before sending a large body and waits a second for this; aiohttp's low-level
            # server leaves the answer to the handler (its web.Application sends it the same way).
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0
        try:
            body = await asyncio.wait_for(request.read(), BODY_TIMEOUT_SECONDS)
        except web.HTTPRequestEntityTooLarge:
            return _too_large()
        except TimeoutError:
            message = f"The request body did not arrive within {BODY_TIMEOUT_SECONDS:g} s."
            payload = error_body(grpc.StatusCode.DEADLINE_EXCEEDED, message)
            payload["error"]["code"] = 408
            response = web.json_response(payload, status=408)
            response.force_close()
            return response
        except (ConnectionError, ClientPayloadError) as error:
            # The client went away (or broke off its body): nobody is left to answer; not the server's fault.
            logger.debug("REST %s %s: the body was cut short: %s", request.method, raw_path, error)
            response = web.Response(status=400)
            response.force_close()
            return response
        try:
            transport = request.transport
            client = peer_name(transport.get_extra_info("peername")) if transport is not None else None
            status, payload_bytes = await gateway.call(
                request.method, raw_path, request.rel_url.query.items(), body, request.headers, client
            )
        except Exception:  # a bug here: say so in the log, and answer in the JSON form all the same
            logger.exception("REST %s %s failed", request.method, raw_path)
            message = f"The server failed to handle {request.method} {raw_path}; see its log."
            return web.json_response(error_body(grpc.StatusCode.INTERNAL, message), status=500)
        return web.Response(
            status=status, body=payload_bytes, content_type="application/json", charset="utf-8"
        )

    def make_request(message: Any, payload: Any, protocol: Any, writer: Any, task: Any) -> web.BaseRequest:
        # The head is in: its timer stops (see _RestProtocol).
        if isinstance(protocol, _RestProtocol):
            protocol.head_complete()
        return web.BaseRequest(
            message,
            payload,
            protocol,
            writer,
            task,
            asyncio.get_running_loop(),
            client_max_size=MAX_BODY_BYTES,
        )

    return _RestServer(handle, request_factory=make_request, keepalive_timeout=KEEPALIVE_TIMEOUT_SECONDS)


class ByteBudget:
    """An asyncio semaphore counted in bytes, granted first come, first served."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.available = capacity
        self._waiting: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    @staticmethod
    def weight(content_length: int | None) -> int:
        """What a body of ``content_length`` bytes (None: unstated) counts for."""
        if content_length is None:
            return MAX_BODY_BYTES
        return 0 if content_length < SMALL_BODY_BYTES else min(content_length, MAX_BODY_BYTES)

    async def acquire(self, size: int) -> None:
        """Wait until ``size`` bytes (at most the capacity) are free, and take them."""
        size = min(size, self.capacity)
        if not size:
            return
        if not self._waiting and self.available >= size:
            self.available -= size
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.append((size, waiter))
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release(size)  # granted just as it was cancelled: give it back
            else:
                self._waiting.remove((size, waiter))
                self._wake()
            raise

    def release(self, size: int) -> None:
        """Give back what :meth:`acquire` took."""
        size = min(size, self.capacity)
        if size:
            self.available += size
            self._wake()

    def _wake(self) -> None:
        while self._waiting and self._waiting[0][0] <= self.available:
            size, waiter = self._waiting.popleft()
            if not waiter.done():
                self.available -= size
                waiter.set_result(None)


def _too_large() -> Any:
    from aiohttp import web

    message = f"Request payload size exceeds the limit: {MAX_BODY_BYTES} bytes."
    payload = error_body(grpc.StatusCode.INVALID_ARGUMENT, message)
    payload["error"]["code"] = 413
    response = web.json_response(payload, status=413)
    response.force_close()  # its body may still be on the way: the connection cannot carry another request
    return response


def _rest_server_classes() -> tuple[Any, Any]:
    from aiohttp import web, web_protocol

    class RestProtocol(web_protocol.RequestHandler):
        """aiohttp's HTTP/1.1 protocol with a time limit on each request's head (aiohttp has none): from
        the first byte of a request until its head is parsed, at most :data:`HEAD_TIMEOUT_SECONDS`, or the
        connection is closed (a client trickling a header a byte at a time holds nothing for long)."""

        _head_timer: asyncio.TimerHandle | None = None
        _in_request = False

        def data_received(self, data: bytes) -> None:
            if self._head_timer is None and not self._in_request and self.transport is not None:
                self._head_timer = asyncio.get_running_loop().call_later(
                    HEAD_TIMEOUT_SECONDS, self._head_too_slow
                )
            super().data_received(data)

        def head_complete(self) -> None:
            self._in_request = True
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def request_done(self) -> None:
            self._in_request = False

        def _head_too_slow(self) -> None:
            self._head_timer = None
            if self.transport is not None:
                logger.debug("closing a REST connection: no request head within %g s", HEAD_TIMEOUT_SECONDS)
                self.transport.close()

        def connection_lost(self, exc: BaseException | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

    class RestServer(web.Server):
        """aiohttp's low-level server making :class:`RestProtocol` protocols."""

        def __call__(self) -> Any:
            kwargs = getattr(self, "_kwargs", {})
            return RestProtocol(self, loop=self._loop, **kwargs)

    return RestProtocol, RestServer


_RestProtocol, _RestServer = _rest_server_classes()
