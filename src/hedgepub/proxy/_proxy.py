"""The proxy's life: :class:`AsyncProxy` on the caller's event loop, :class:`Proxy` on a thread of its own
(as :class:`~hedgepub.server.LocalServer` runs the server), and :func:`upstream_target`, the one reading
of ``--upstream``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
import grpc.aio

from hedgepub._clock import DEFAULT_CLOCK
from hedgepub._publisher.builder import build_core
from hedgepub._publisher.core import _PublisherCore
from hedgepub._publisher.stats import PublisherStats
from hedgepub._service_thread import ServiceThread
from hedgepub._settings import BatchSettings, FlowControlSettings, HedgingSettings, RetrySettings
from hedgepub._transport.grpc import (
    CHANNEL_OPTIONS,
    DEFAULT_ENDPOINT,
    MAX_MESSAGE_LENGTH,
    AuthHeaders,
    ChannelTarget,
    parse_endpoint,
)
from hedgepub.proxy._forwarder import Forwarder, InFlightBytes

__all__ = ["DEFAULT_MAX_IN_FLIGHT_BYTES", "AsyncProxy", "Proxy", "upstream_target"]

#: Bytes of requests the proxy forwards at once unless told otherwise: 64 MiB, six requests of the
#: service's largest (10 MB) or thousands of usual ones; more is answered RESOURCE_EXHAUSTED.
DEFAULT_MAX_IN_FLIGHT_BYTES = 64 * 1024 * 1024
#: The name of Google Cloud Pub/Sub as an upstream.
GOOGLE = "google"
#: What the proxy's port accepts: requests of the service's size, and a bound on what the server takes in.
_SERVER_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_LENGTH),
    ("grpc.max_receive_message_length", MAX_MESSAGE_LENGTH),
)


def upstream_target(upstream: str) -> ChannelTarget:
    """Where the proxy forwards to: ``"google"`` (Google Cloud Pub/Sub over TLS, with Application
    Default Credentials for callers that send none), or an endpoint as ``--endpoint`` reads it
    (``HOST:PORT`` plain text unless the port is 443, ``http://...``, ``https://...``). ``ValueError``
    for a malformed one."""
    text = upstream.strip()
    if text == GOOGLE:
        return ChannelTarget(DEFAULT_ENDPOINT, secure=True, source="default")
    return parse_endpoint(text)


class AsyncProxy:
    """``hedgepub proxy`` on the running event loop: a gRPC port that forwards every ``google.pubsub.v1``
    RPC to ``upstream`` and hedges Publish (see :mod:`hedgepub.proxy`).

    ``hedging_settings`` (``None``: no hedging), ``retry_settings``, ``hedge_endpoints`` and
    ``channel_pool_size`` are those of :class:`~hedgepub.PublisherClient`, for the Publish calls it
    forwards. ``credentials`` (google-auth) are added to calls whose caller sent no ``authorization``; in
    front of Google without them, Application Default Credentials are. ``root_certificates`` (PEM) are
    what a TLS upstream is trusted by. ``max_in_flight_bytes`` bounds the bytes of requests being
    forwarded at once. ``enable_open_telemetry`` (with ``tracer_provider`` and ``meter_provider``, as the
    publisher takes them) reports the forwarded publishes' spans and metrics: attempts, hedges sent and
    won, per topic.
    """

    def __init__(
        self,
        upstream: str = GOOGLE,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        hedging_settings: HedgingSettings | None = None,
        retry_settings: RetrySettings | None = None,
        hedge_endpoints: Sequence[str] = (),
        channel_pool_size: int | None = None,
        credentials: Any = None,
        root_certificates: bytes | None = None,
        max_in_flight_bytes: int = DEFAULT_MAX_IN_FLIGHT_BYTES,
        enable_open_telemetry: bool = False,
        tracer_provider: Any = None,
        meter_provider: Any = None,
    ) -> None:
        self.upstream = upstream_target(upstream)
        self.host = host
        self.port = port
        self._hedging = hedging_settings
        self._retry = retry_settings if retry_settings is not None else RetrySettings()
        self._hedge_endpoints = tuple(hedge_endpoints)
        self._pool_size = channel_pool_size
        self._credentials = credentials
        self._root_certificates = root_certificates
        self.in_flight = InFlightBytes(max_in_flight_bytes)
        self._otel = enable_open_telemetry
        self._providers = {"tracer_provider": tracer_provider, "meter_provider": meter_provider}
        self._core: _PublisherCore | None = None
        self._channel: grpc.aio.Channel | None = None
        self._server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        """``host:port`` of the proxy's port (clients' ``PUBSUB_EMULATOR_HOST``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def _endpoint(self) -> str:
        target = self.upstream
        return ("https://" if target.secure else "http://") + target.target

    async def start(self) -> None:
        """Build the publisher core, open the upstream channel and the port (``OSError`` if it cannot)."""
        core = build_core(
            hedging_settings=self._hedging,
            batch_settings=BatchSettings(),
            retry_settings=self._retry,
            flow_control=FlowControlSettings(),
            enable_message_ordering=False,
            endpoint=self._endpoint(),
            credentials=self._credentials,
            transport=None,
            clock=DEFAULT_CLOCK,
            sync_futures=False,
            hedge_endpoints=self._hedge_endpoints or None,
            channel_pool_size=self._pool_size,
            root_certificates=self._root_certificates,
            enable_open_telemetry=self._otel,
            **self._providers,
        )
        core.bind_running_loop()
        self._core = core
        target = self.upstream
        if target.secure:
            credentials = grpc.ssl_channel_credentials(root_certificates=self._root_certificates)
            channel = grpc.aio.secure_channel(target.target, credentials, options=CHANNEL_OPTIONS)
        else:
            channel = grpc.aio.insecure_channel(target.target, options=CHANNEL_OPTIONS)
        self._channel = channel
        host = target.target.removesuffix(":443")

        def auth(service: str) -> AuthHeaders | None:
            return core.auth_headers(f"https://{host}/{service}")

        server = grpc.aio.server(
            handlers=[Forwarder(channel, core, self.in_flight, auth)], options=_SERVER_OPTIONS
        )
        bound = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        try:
            port = server.add_insecure_port(bound)
        except RuntimeError as error:  # grpc's way of saying the address cannot be bound
            await self._close_upstream()
            raise OSError(f"cannot listen on {bound}: {error}") from None
        self.port = port
        await server.start()
        self._server = server

    async def stop(self, grace: float | None = 1.0) -> None:
        """Stop taking calls (those in flight get ``grace`` seconds), then close the upstream."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace)
        await self._close_upstream()

    async def _close_upstream(self) -> None:
        core, self._core = self._core, None
        if core is not None:
            await core.shutdown(0)
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close(None)

    async def wait_closed(self) -> None:
        """Serve until :meth:`stop` (from another task)."""
        if self._server is not None:
            await self._server.wait_for_termination()

    def stats(self) -> PublisherStats:
        """The Publish calls forwarded: messages, attempts, hedges sent and won, latency percentiles, the
        tokens of each topic's bucket (as :meth:`hedgepub.PublisherClient.stats`)."""
        if self._core is None:
            raise RuntimeError("the proxy is not running")
        return self._core.stats()

    async def __aenter__(self) -> AsyncProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


class Proxy:
    """The proxy on its own thread and event loop (the arguments are :class:`AsyncProxy`'s); for tests,
    notebooks and a process that has no event loop of its own::

        with Proxy("127.0.0.1:8085", hedging_settings=HedgingSettings(hedge_delay=0.05)) as proxy:
            os.environ["PUBSUB_EMULATOR_HOST"] = proxy.address
    """

    def __init__(self, upstream: str = GOOGLE, **options: Any) -> None:
        self._proxy = AsyncProxy(upstream, **options)
        self._runner = ServiceThread("hedgepub-proxy", self._proxy.start, self._proxy.stop)

    @property
    def address(self) -> str:
        """``host:port`` of the running proxy."""
        return self._proxy.address

    @property
    def in_flight(self) -> InFlightBytes:
        """The bytes of requests being forwarded, their bound and the requests refused."""
        return self._proxy.in_flight

    def stats(self) -> PublisherStats:
        """See :meth:`AsyncProxy.stats` (any thread)."""
        return self._proxy.stats()

    def start(self) -> Proxy:
        """Start on a new thread; returns once the port is open (raises what stopped it otherwise)."""
        self._runner.start()
        return self

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop (calls in flight get ``grace`` seconds) and wait for the thread to end."""
        self._runner.stop(grace)

    def __enter__(self) -> Proxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
