"""The transport: where the publisher meets gRPC.

Everything gRPC-specific about publishing lives here, behind a one-method seam
(:class:`Transport`): *publish this request, with this metadata, within this timeout, and give me the
message IDs*. The real implementation (:class:`GrpcTransport`) calls ``google.pubsub.v1.Publisher/Publish``
on a ``grpc.aio`` channel with the raw protobuf classes (never the proto-plus wrappers, which are several
times slower); :class:`ScriptedTransport` answers from a script, for unit tests on virtual time.

Which channel is used (:func:`resolve_endpoint`, :func:`create_channel`):

1. an explicit ``endpoint`` wins (:func:`parse_endpoint`, which the CLI uses too). ``"https://host[:port]"``
   means TLS, ``"http://host:port"`` means plain text; a bare ``"host:port"`` means TLS when the port is
   443 or ``credentials`` were given, plain text otherwise (emulators and local servers listen on other
   ports); a bare ``"host"`` only for Google's endpoints (``*.googleapis.com``, TLS on 443); a malformed
   endpoint, or one without a port (``"localhost"``), is a ``ValueError``;
2. otherwise ``PUBSUB_EMULATOR_HOST``: plain text, no credentials, as every official client does (a
   ``host`` without ``:port`` is a ``ValueError``);
3. otherwise the Google Cloud Pub/Sub endpoint over TLS, authenticated with the ``credentials`` given or
   with Application Default Credentials found by google-auth.

A TLS channel trusts the system's root certificates, or only the PEM ``root_certificates`` given
(``PublisherClient(root_certificates=...)``), for a private CA or ``hedgepub serve --tls-cert``.

On a plain-text channel, ``credentials`` given explicitly still identify the caller: their token goes in
``authorization: Bearer ...`` metadata on every call (gRPC refuses call credentials without TLS), which is
how a local server with IAM enforcement (``hedgepub serve --iam enforce``) learns who publishes, e.g.
``credentials=google.oauth2.credentials.Credentials("t-alice")`` with ``endpoint="http://127.0.0.1:8085"``
or ``PUBSUB_EMULATOR_HOST``. Without explicit credentials nothing is sent, as before.

On both kinds of channel the token is checked before every attempt (hedges included): within 5 minutes of its
expiry it is refreshed in the background while attempts go on with it (:class:`TokenRefresher`, one refresh
for every channel of a publisher); a missing or expired one is refreshed while the attempts wait, once for
all of them. A token that cannot be refreshed fails the attempt
with ``UNAUTHENTICATED`` (not retried by default), whose message names the credentials and google-auth's
reason; a refresh error google-auth marks retryable (the token endpoint unreachable) is ``UNAVAILABLE``.

gRPC errors are translated to hedgepub's at one boundary, :func:`map_rpc_error`::

    grpc.aio.AioRpcError(code=grpc.StatusCode.X)  ->  hedgepub.RpcError(StatusCode.X, details)

where the ``RpcError`` is of the code's class (``NOT_FOUND``: ``hedgepub._exceptions.NotFound``, also a
``google.api_core.exceptions.NotFound``).
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import quote

import grpc
import grpc.aio
from google.pubsub_v1.types import pubsub as _pubsub_types

from hedgepub._exceptions import RpcError
from hedgepub._status import StatusCode
from hedgepub._wire import (
    AUTHORIZATION_KEY,
    BATCH_ID_KEY,
    CLIENT_TELEMETRY_KEY,
    EMULATOR_HOST_ENV,
    REQUEST_PARAMS_KEY,
    encode_client_telemetry,
)

#: Raw protobuf classes of the Publish RPC (``Message.pb()`` with no argument returns the raw class).
PublishRequestPb: Any = _pubsub_types.PublishRequest.pb()
PublishResponsePb: Any = _pubsub_types.PublishResponse.pb()
PubsubMessagePb: Any = _pubsub_types.PubsubMessage.pb()

#: The Google Cloud Pub/Sub endpoint used when neither an endpoint nor an emulator is configured.
DEFAULT_ENDPOINT = "pubsub.googleapis.com:443"
#: OAuth scopes asked for when Application Default Credentials are used.
SCOPES = ("https://www.googleapis.com/auth/cloud-platform", "https://www.googleapis.com/auth/pubsub")
PUBLISH_METHOD = "/google.pubsub.v1.Publisher/Publish"

#: The keepalive ping interval (ms): the shortest Google's front ends accept (see CHANNEL_OPTIONS).
KEEPALIVE_TIME_MS = 30_000
#: How long a keepalive ping may go unanswered before the connection is closed (ms).
KEEPALIVE_TIMEOUT_MS = 10_000
#: A message may be up to 10 MB and a request a little more; leave head room over both.
MAX_MESSAGE_LENGTH = 20 * 1024 * 1024
CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_LENGTH),
    ("grpc.max_receive_message_length", MAX_MESSAGE_LENGTH),
    # A ping 30 s after the last activity, while calls are open, answered within 10 s or the connection
    # is closed: Google's front ends refuse pings more frequent than every 30 s (GOAWAY too_many_pings,
    # after which gRPC doubles the interval for good), so 30 s is the shortest interval that keeps its
    # meaning. A dead connection is left much sooner by the pool's own silence check
    # (hedgepub._transport.pool); keepalive is the bound for the calls the pool cannot see.
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
)
#: What a pool's channel adds: a subchannel pool of its own, so that it is its own TCP connection (gRPC
#: shares one subchannel among channels of the same target and arguments otherwise).
POOL_CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (("grpc.use_local_subchannel_pool", 1),)
#: The RPC a silent connection is probed with: any answer, even UNIMPLEMENTED, proves the connection
#: carries calls again; it needs no permission and costs the service no quota.
PROBE_METHOD = "/grpc.health.v1.Health/Check"

Metadata = Sequence[tuple[str, str]]

_GRPC_TO_STATUS: dict[grpc.StatusCode, StatusCode] = {
    code: StatusCode(code.value[0]) for code in grpc.StatusCode
}


def map_rpc_error(error: grpc.RpcError) -> RpcError:
    """Translate a gRPC error into hedgepub's :class:`~hedgepub.RpcError` (the one place this happens).

    The result is the class of its code (``NotFound``, ``PermissionDenied``, ...), which is also the
    ``google.api_core.exceptions`` class of that code, with the status message and the ``google.rpc``
    details of the ``grpc-status-details-bin`` trailer (``ErrorInfo`` and the others), as the official
    client reads them. A status that is not a failure (``OK``, which a broken server could send with no
    response) becomes ``UNKNOWN``, because the caller has no message IDs.
    """
    code_method = getattr(error, "code", None)
    grpc_code = code_method() if callable(code_method) else None
    code = _GRPC_TO_STATUS.get(grpc_code, StatusCode.UNKNOWN)  # type: ignore[arg-type]  # None: UNKNOWN
    if code is StatusCode.OK:
        code = StatusCode.UNKNOWN
    details_method = getattr(error, "details", None)
    details = details_method() if callable(details_method) else str(error)
    error_details, error_info = _status_details(error)
    return RpcError(code, details or "", error_details=error_details, error_info=error_info, response=error)


def _status_details(error: grpc.RpcError) -> tuple[list[Any], Any]:
    """The ``google.rpc`` details of a status and its ``ErrorInfo``, read as google-api-core reads them."""
    if not callable(getattr(error, "trailing_metadata", None)):
        return [], None
    try:
        from google.api_core.exceptions import _parse_grpc_error_details

        details, error_info = _parse_grpc_error_details(error)
    except Exception:  # a malformed trailer, or a google-api-core without the helper: the status stands
        return [], None
    return list(details), error_info


@functools.lru_cache(maxsize=1024)
def _routing_header(topic: str) -> str:
    """The routing header's value for ``topic`` (kept: quoting it was a tenth of a batch's own work)."""
    return "topic=" + quote(topic, safe="/")


def request_metadata(
    topic: str, batch_id: str, attempt: int, publish_start_time: float | None = None
) -> tuple[tuple[str, str], ...]:
    """The gRPC metadata of one attempt (docs/hedging.md, rule 8): the routing header, Google's client
    telemetry header (``attempt`` as ``hedged_attempt_count``, the batch's ``publish_start_time`` in
    seconds since the epoch) and hedgepub's batch id."""
    return (
        (REQUEST_PARAMS_KEY, _routing_header(topic)),
        (CLIENT_TELEMETRY_KEY, encode_client_telemetry(attempt, publish_start_time)),
        (BATCH_ID_KEY, batch_id),
    )


class Transport(Protocol):
    """One connection that sends Publish requests: the seam between the publisher and the network.

    :class:`GrpcTransport` is the real one; :class:`~hedgepub.testing.scripted.ScriptedTransport` answers
    from a script. The publisher's connection pool (:mod:`hedgepub._transport.pool`) uses every member.
    """

    #: Whether the connection was ready (connected) when last seen; the pool sends an attempt to a ready
    #: connection while there is one. A transport that cannot tell leaves it true.
    ready: bool

    async def publish(self, request: bytes, metadata: Metadata, timeout: float) -> Sequence[str]:
        """Publish ``request``, a serialized ``PublishRequest`` (as a batch keeps it), and return its
        message IDs (a tuple, which the hedging engine keeps as it is, or any sequence).

        Raises :class:`~hedgepub.RpcError` for a status; cancelling the awaiting task cancels the RPC.
        """

    def connected(self) -> bool | None:
        """Whether the connection is connected now (``None``: cannot tell). A failed call on a connection
        that is not could not reach the server; one on a connected connection got the server's answer."""

    def keep_connected(self) -> bool:
        """Connect now if not connected, and update :attr:`ready`. Whether there is a connection to keep:
        the pool calls this again every :data:`~hedgepub._transport.pool.KEEP_WARM` seconds while any of
        its transports says so, and before an attempt on one it last saw not ready."""

    async def wait_ready(self, timeout: float) -> bool:
        """Wait, at most ``timeout`` seconds, while the connection is being made; whether it is ready. A
        failed connection ends the wait at once; a transport that cannot tell answers :attr:`ready`."""

    async def probe(self, timeout: float) -> bool:
        """Whether the other end answers a tiny call on this connection within ``timeout`` (a silent
        connection is probed before it is replaced)."""

    async def close(self) -> None:
        """Release the connection."""


@dataclass(frozen=True)
class ChannelTarget:
    """Where to connect, whether over TLS, and where the endpoint came from (for messages).

    ``source`` is ``"endpoint"`` (given explicitly), ``"PUBSUB_EMULATOR_HOST"`` or ``"default"``. A TLS
    channel to an emulator carries no credentials unless some were given, as a plain-text one.
    """

    target: str
    secure: bool
    # Not part of equality: two targets that connect alike are alike, whoever named them.
    source: str = field(default="endpoint", compare=False)

    def describe(self) -> str:
        """``host:port`` and where it came from, as log lines and errors name it."""
        scheme = "https://" if self.secure else "http://"
        origin = {"endpoint": "", "default": " (Google Cloud Pub/Sub)"}.get(
            self.source, f" (from {self.source})"
        )
        return f"{scheme}{self.target}{origin}"


#: The endpoint forms :func:`parse_endpoint` accepts, for error messages.
ENDPOINT_FORMS = "HOST:PORT, http://HOST:PORT (plain text) or https://HOST[:PORT] (TLS)"


def parse_endpoint(endpoint: str, *, credentials: object | None = None) -> ChannelTarget:
    """The channel target an explicit endpoint names; the one parser for the client and the CLI.

    ``"https://host[:port]"`` means TLS (port 443 by default), ``"http://host[:port]"`` plain text (port 80
    by default), and a bare ``"host:port"`` TLS when the port is 443 or ``credentials`` were given, plain
    text otherwise. A bare ``"host"`` without a port is only taken for Google's own endpoints (a name
    ending ``.googleapis.com``: ``host:443`` over TLS, as the official client takes them); any other
    (``"localhost"``, a container's name) raises ``ValueError`` saying that the port is missing, where
    TLS on 443 would need Google credentials and fail with a credentials error that never names the
    port. ``unix:PATH`` is passed to gRPC as is (plain text). Anything else (another scheme, a path, a
    port that is not a number from 1 to 65535, no host) raises ``ValueError`` naming the accepted forms.
    """
    text = endpoint.strip()
    if text.startswith(("unix:", "unix-abstract:")):
        return ChannelTarget(text, secure=False)
    scheme, separator, rest = text.partition("://")
    if not separator:
        scheme, rest = "", text
    elif scheme not in ("http", "https"):
        raise ValueError(f"endpoint {endpoint!r}: unknown scheme {scheme + '://'!r}; use {ENDPOINT_FORMS}")
    rest = rest.rstrip("/")
    host, port = _split_host_port(rest, endpoint)
    if scheme == "https":
        return ChannelTarget(f"{host}:{port or 443}", secure=True)
    if scheme == "http":
        return ChannelTarget(f"{host}:{port or 80}", secure=False)
    if port is None:
        if not host.lower().endswith(GOOGLE_DOMAIN):
            raise ValueError(missing_port(f"endpoint {endpoint!r}", host))
        return ChannelTarget(f"{host}:443", secure=True)
    return ChannelTarget(f"{host}:{port}", secure=credentials is not None or port == 443)


#: The domain of Google's own endpoints, the only ones a bare host without a port may name.
GOOGLE_DOMAIN = ".googleapis.com"


def missing_port(what: str, host: str, *, tls: bool = True) -> str:
    """The message for an endpoint without a port (``what`` names it: ``endpoint 'localhost'``), with
    the ``https://`` form for TLS on 443 when ``tls``."""
    advice = f"give HOST:PORT ('{host}:8085' for a local server or emulator)"
    return f"{what} names no port: {advice}" + (f", or https://{host} for TLS on port 443" if tls else "")


def _split_host_port(text: str, endpoint: str) -> tuple[str, int | None]:
    """(host, port or None) of ``host``, ``host:port``, ``[v6]`` or ``[v6]:port``; ValueError otherwise."""
    problem = f"endpoint {endpoint!r} is not of the form {ENDPOINT_FORMS}"
    if "/" in text or any(character.isspace() for character in text):
        raise ValueError(problem)
    if text.startswith("["):  # bracketed IPv6 literal
        closing = text.find("]")
        if closing < 2:
            raise ValueError(problem)
        host, after = text[: closing + 1], text[closing + 1 :]
        if after and not after.startswith(":"):
            raise ValueError(problem)
        port_text = after[1:] if after else None
    else:
        host, colon, port_text_or_empty = text.partition(":")
        port_text = port_text_or_empty if colon else None
    if not host or (port_text is not None and not (port_text.isdigit() and 1 <= int(port_text) <= 65535)):
        raise ValueError(problem)
    return host, None if port_text is None else int(port_text)


def resolve_endpoint(
    endpoint: str | None = None, *, credentials: object | None = None, environ: Any = None
) -> ChannelTarget:
    """Decide the channel target: explicit ``endpoint``, else ``PUBSUB_EMULATOR_HOST``, else Google.

    An explicit endpoint goes through :func:`parse_endpoint` (``ValueError`` if malformed). The emulator
    variable's ``host:port`` means plain text whatever the port, as every official client takes it; an
    ``http://`` or ``https://`` form is read as ``--endpoint`` reads it (``https://``: TLS, without
    credentials unless some were given).
    """
    environ = os.environ if environ is None else environ
    if endpoint:
        return parse_endpoint(endpoint, credentials=credentials)
    emulator = environ.get(EMULATOR_HOST_ENV, "").strip()
    if emulator:
        if "://" in emulator:
            try:
                parsed = parse_endpoint(emulator)
            except ValueError as error:
                raise ValueError(f"{EMULATOR_HOST_ENV}: {error}") from None
            return ChannelTarget(parsed.target, parsed.secure, source=EMULATOR_HOST_ENV)
        if ":" not in emulator:  # gRPC would take port 443 (in plain text), where no emulator listens
            raise ValueError(missing_port(f"{EMULATOR_HOST_ENV}={emulator!r}", emulator, tls=False))
        return ChannelTarget(emulator, secure=False, source=EMULATOR_HOST_ENV)
    return ChannelTarget(DEFAULT_ENDPOINT, secure=True, source="default")


#: How long before its expiry a token is refreshed in the background, while attempts go on using it. Above
#: google-auth's own threshold (3 min 45 s), where ``credentials.valid`` turns false, so that the refresh
#: is under way before google-auth would have every caller wait for it.
REFRESH_AHEAD_SECONDS = 300.0
#: A token this close to its expiry (or past it) is not sent: attempts wait for the refresh, as a missing one.
EXPIRY_MARGIN_SECONDS = 10.0


class TokenRefresher:
    """Keeps google-auth credentials' token fresh for every channel of a publisher (one per publisher, so
    that its pool's connections share each refresh).

    A token within :data:`REFRESH_AHEAD_SECONDS` of its expiry is refreshed in the background (in a thread,
    once at a time), and attempts go on with it meanwhile; a missing token, or one within
    :data:`EXPIRY_MARGIN_SECONDS` of its expiry or past it, makes the attempts wait for the refresh (the
    one under way, or a new one), as before.
    """

    def __init__(self, credentials: Any) -> None:
        self.credentials = credentials
        self._auth_request: Any = None
        self._refresh_lock: asyncio.Lock | None = None
        self._refreshing: asyncio.Future[None] | None = None
        #: Refreshes started ahead of expiry, and those that failed (logged; retried at the next call).
        self.background_refreshes = 0
        #: Seconds the newest token had left when it arrived: a short-lived token is refreshed ahead at half
        #: its life, not 5 minutes before it ends (which would refresh it on every call).
        self._lifetime: float | None = None

    @property
    def auth_request(self) -> Any:
        """google-auth's HTTP request object (made on first use)."""
        if self._auth_request is None:
            import google.auth.transport.requests

            self._auth_request = google.auth.transport.requests.Request()
        return self._auth_request

    def _seconds_left(self) -> float | None:
        """Seconds until the token expires (None: no expiry known)."""
        expiry = getattr(self.credentials, "expiry", None)
        if expiry is None:
            return None
        from google.auth import _helpers

        return float((expiry - _helpers.utcnow()).total_seconds())

    def _start_refresh(self) -> asyncio.Future[None]:
        """The refresh under way, or a new one (in a thread: it may block on HTTP)."""
        if self._refreshing is None or self._refreshing.done():
            loop = asyncio.get_running_loop()
            self._refreshing = loop.run_in_executor(None, self.credentials.refresh, self.auth_request)
            self._refreshing.add_done_callback(_forget)
            self._refreshing.add_done_callback(self._note_lifetime)
        return self._refreshing

    def _note_lifetime(self, future: asyncio.Future[None]) -> None:
        if not future.cancelled() and future.exception() is None:
            self._lifetime = self._seconds_left()

    async def fresh(self) -> bool:
        """Make the token usable, waiting only when it is missing or expired; True when it is valid for
        google-auth (``before_request`` may be used), False when it is usable but due for its refresh
        (already started in the background)."""
        import google.auth.exceptions

        credentials = self.credentials
        token = getattr(credentials, "token", None)
        left = self._seconds_left()
        ahead = (
            REFRESH_AHEAD_SECONDS
            if self._lifetime is None
            else min(REFRESH_AHEAD_SECONDS, self._lifetime / 2)
        )
        if credentials.valid and (left is None or left > ahead):
            return True
        if token and left is not None and left > EXPIRY_MARGIN_SECONDS:
            # Due for its refresh but not expired: refresh in the background, go on with this token.
            if self._refreshing is None or self._refreshing.done():
                self.background_refreshes += 1
                self._start_refresh()
            return bool(credentials.valid)
        if self._refresh_lock is None:
            self._refresh_lock = asyncio.Lock()
        async with self._refresh_lock:  # one refresh at a time; those waiting reuse its token
            left = self._seconds_left()
            if credentials.valid and (left is None or left > EXPIRY_MARGIN_SECONDS):
                return True
            try:
                await asyncio.shield(self._start_refresh())
            except google.auth.exceptions.GoogleAuthError as error:
                retryable = bool(getattr(error, "retryable", False))
                raise RpcError(
                    StatusCode.UNAVAILABLE if retryable else StatusCode.UNAUTHENTICATED,
                    f"the access token of the {type(credentials).__name__} credentials is missing or "
                    f"expired and could not be refreshed: {error}",
                ) from error
        return True


def _forget(future: asyncio.Future[None]) -> None:
    # A background refresh that failed is retried by the next call (and, once the token expires, waited
    # for and reported); reading the error keeps asyncio from logging it as never retrieved.
    if not future.cancelled() and future.exception() is not None:
        import logging

        logging.getLogger("hedgepub").warning(
            "hedgepub: refreshing the access token ahead of its expiry failed: %s", future.exception()
        )


class AuthHeaders:
    """The ``authorization`` header (and any other google-auth adds) of google-auth credentials, for calls
    to one service, with a token kept fresh by a :class:`TokenRefresher`.

    What every call of the publisher's channels carries (:class:`_BearerTokenInterceptor`), and what
    ``hedgepub proxy`` adds to the calls it forwards for a caller that sent none.
    """

    def __init__(self, credentials: Any, service_url: str, refresher: TokenRefresher | None = None) -> None:
        self.refresher = refresher if refresher is not None else TokenRefresher(credentials)
        self.credentials = credentials
        self.service_url = service_url

    async def fresh(self) -> dict[str, str]:
        """The headers, lower-case keys, with a token that is usable now (waiting only for a missing or
        expired one; see :meth:`TokenRefresher.fresh`). Raises :class:`~hedgepub.RpcError`
        (``UNAUTHENTICATED``, or ``UNAVAILABLE`` when google-auth says to retry) when it cannot be had."""
        refresher = self.refresher
        valid = await refresher.fresh()
        headers: dict[str, str] = {}
        if valid:
            # The token is valid, so this only adds headers (and, for self-signed JWT credentials, signs
            # one for this service's audience, as gRPC's own plugin would).
            self.credentials.before_request(refresher.auth_request, "POST", self.service_url, headers)
        else:  # usable, its refresh under way: google-auth's before_request would wait for a refresh
            self.credentials.apply(headers)
        return {key.lower(): value for key, value in headers.items()}


class _BearerTokenInterceptor(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[type-arg]  # generic in the stubs only
    """Puts google-auth credentials' ``authorization`` header on every call (:class:`AuthHeaders`), unless
    the call has one already: a request that ``hedgepub proxy`` forwards carries its caller's own token,
    which goes through as it is.

    Used on TLS and plain-text channels alike, rather than gRPC's call-credentials plugin, for three
    reasons: a token that cannot be refreshed must fail the publish at once with a clear error (through the
    plugin it surfaces as a retryable ``UNAVAILABLE`` and is retried until the total timeout), concurrent
    attempts (a batch and its hedges, on every connection of the pool) must share one refresh rather than
    each start their own, and a token due for its refresh must be refreshed off the publish path.
    """

    def __init__(self, credentials: Any, service_url: str, refresher: TokenRefresher | None = None) -> None:
        self.headers = AuthHeaders(credentials, service_url, refresher)

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        given = client_call_details.metadata or ()
        if any(key == AUTHORIZATION_KEY for key, _value in given):
            return await continuation(client_call_details, request)
        headers = await self.headers.fresh()
        metadata = [*given, *headers.items()]
        return await continuation(client_call_details._replace(metadata=metadata), request)


def create_channel(
    target: ChannelTarget,
    credentials: object | None = None,
    *,
    root_certificates: bytes | None = None,
    own_connection: bool = False,
    refresher: TokenRefresher | None = None,
) -> grpc.aio.Channel:
    """Open a ``grpc.aio`` channel to ``target`` (call from inside the event loop that will use it).

    ``own_connection`` gives the channel a subchannel pool of its own, hence a TCP connection no other
    channel shares (a connection pool's members). ``refresher`` is the publisher's token refresher, shared
    by its channels (default: one of this channel's own).

    A secure channel carries google-auth credentials: the ones given, or Application Default
    Credentials; it trusts the system's root certificates, or only ``root_certificates`` (PEM) when
    given (a private CA, a local server with a throwaway certificate). A plain-text channel carries only
    credentials given explicitly, as metadata.
    """
    options = CHANNEL_OPTIONS + POOL_CHANNEL_OPTIONS if own_connection else CHANNEL_OPTIONS
    host = target.target.removesuffix(":443")
    service_url = f"https://{host}/google.pubsub.v1.Publisher"
    if not target.secure:
        interceptors = (
            [_BearerTokenInterceptor(credentials, service_url, refresher)]
            if credentials is not None
            else None
        )
        return grpc.aio.insecure_channel(
            target.target,
            options=options,
            # grpc-stubs types aio's client interceptors as a placeholder class "to cast to or ignore".
            interceptors=interceptors,  # type: ignore[arg-type]
        )
    import google.auth

    if credentials is None and target.source == EMULATOR_HOST_ENV:  # an emulator over TLS: no credentials
        return grpc.aio.secure_channel(
            target.target,
            grpc.ssl_channel_credentials(root_certificates=root_certificates),
            options=options,
        )
    if credentials is None:
        credentials, _project = google.auth.default(scopes=SCOPES)
    return grpc.aio.secure_channel(
        target.target,
        grpc.ssl_channel_credentials(root_certificates=root_certificates),
        options=options,
        interceptors=[_BearerTokenInterceptor(credentials, service_url, refresher)],  # type: ignore[list-item]  # as above
    )


class GrpcTransport(Transport):
    """The real transport: ``Publisher/Publish`` over a ``grpc.aio`` channel, the request's bytes as they
    are (a batch keeps them serialized)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._channel = channel
        self._publish = channel.unary_unary(
            PUBLISH_METHOD,
            request_serializer=None,
            response_deserializer=PublishResponsePb.FromString,
        )
        self._probe = channel.unary_unary(PROBE_METHOD, request_serializer=None, response_deserializer=None)
        #: Whether the channel was READY when last seen (kept up to date by :meth:`keep_connected`).
        self.ready = True

    async def wait_ready(self, timeout: float) -> bool:
        """Wait, at most ``timeout`` seconds, while the channel is connecting (connecting it if idle);
        whether it ended up connected. A connection refused or failed ends the wait at once (False), so
        an attempt on it fails fast as it would have."""
        channel = self._channel
        connecting = (grpc.ChannelConnectivity.IDLE, grpc.ChannelConnectivity.CONNECTING)

        async def watch() -> bool:
            state = channel.get_state(try_to_connect=True)
            while state in connecting:
                await channel.wait_for_state_change(state)
                state = channel.get_state(try_to_connect=True)
            return state is grpc.ChannelConnectivity.READY

        try:
            self.ready = await asyncio.wait_for(watch(), timeout)
        except TimeoutError:
            return False
        return self.ready

    @classmethod
    def connect(
        cls,
        endpoint: str | None = None,
        credentials: object | None = None,
        *,
        root_certificates: bytes | None = None,
    ) -> GrpcTransport:
        """Resolve the endpoint and open a channel to it (inside the event loop that will use it)."""
        target = resolve_endpoint(endpoint, credentials=credentials)
        return cls(create_channel(target, credentials, root_certificates=root_certificates))

    async def publish(self, request: bytes, metadata: Metadata, timeout: float) -> tuple[str, ...]:
        """Send one Publish RPC; a cancelled caller cancels the call on the wire too."""
        call = self._publish(request, timeout=timeout, metadata=metadata)
        try:
            response = await call
        except asyncio.CancelledError:
            call.cancel()
            raise
        except grpc.RpcError as error:
            raise map_rpc_error(error) from error
        return tuple(response.message_ids)

    def keep_connected(self) -> bool:
        """Connect now if the channel is not connected (idle after a drop or a long pause) and note whether
        it is ready (:attr:`ready`). The pool calls this every :data:`~hedgepub._transport.pool.KEEP_WARM`
        seconds: a timer rather than a task waiting on the channel's state, so that nothing of gRPC's is
        left pending while the publisher is idle (a forked child inherits it)."""
        self.ready = self._channel.get_state(try_to_connect=True) is grpc.ChannelConnectivity.READY
        return True

    async def probe(self, timeout: float) -> bool:
        """Whether the other end answers a tiny call (:data:`PROBE_METHOD`) on this connection within
        ``timeout``; any status it sends counts, a timeout or a connection that fails does not."""
        try:
            await self._probe(b"", timeout=timeout)
        except grpc.RpcError as error:
            code = error.code() if callable(getattr(error, "code", None)) else None
            return code not in (
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.CANCELLED,
            )
        except RpcError:  # the token interceptor's refusal: the connection is not what fails
            return True
        return True

    def connected(self) -> bool:
        """Whether the channel is connected now (READY): a failed call on a channel that is not could not
        reach the server, where one on a connected channel got the server's own answer."""
        return self._channel.get_state(try_to_connect=False) is grpc.ChannelConnectivity.READY

    async def close(self) -> None:
        """Close the channel; RPCs still running are cancelled."""
        await self._channel.close(None)  # no grace: calls still running are cancelled

    def __repr__(self) -> str:
        return f"GrpcTransport({self._channel!r})"
