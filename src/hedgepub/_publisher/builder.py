"""The builder: the client's settings in, a wired :class:`~hedgepub._publisher.core._PublisherCore` out.

Everything a publisher is made of is decided here, once, and handed to the core's constructor: the
hedging budget (token bucket, delay source), flow control, the endpoints (credentials, transports), the
stats, the OpenTelemetry instrumentation and the one observer of finished batches. The core itself only
batches and sends.
"""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hedgepub._clock import Clock
from hedgepub._hedging.budget import HedgingBudget
from hedgepub._hedging.delay import AdaptiveDelayEstimator
from hedgepub._publisher.core import _PublisherCore
from hedgepub._publisher.flow_control import FlowController
from hedgepub._publisher.messages import MessagePreparer
from hedgepub._publisher.observer import BatchObserver, BatchObservers
from hedgepub._publisher.routes import EndpointRoutes, check_hedge_endpoints
from hedgepub._publisher.sender import BatchSender
from hedgepub._publisher.stats import StatsRecorder
from hedgepub._settings import (
    BatchSettings,
    FlowControlSettings,
    HedgingSettings,
    RetrySettings,
    adaptive_delay_limit,
    check_hedging,
)
from hedgepub._transport.grpc import (
    ChannelTarget,
    GrpcTransport,
    TokenRefresher,
    Transport,
    create_channel,
    resolve_endpoint,
)
from hedgepub._transport.pool import DEFAULT_POOL_SIZE, ConnectionPool, check_channel_pool_size
from hedgepub._wire import EMULATOR_HOST_ENV

if TYPE_CHECKING:
    from hedgepub._publisher.telemetry import PublisherTelemetry


def build_core(
    *,
    hedging_settings: HedgingSettings | None,
    batch_settings: BatchSettings,
    retry_settings: RetrySettings,
    flow_control: FlowControlSettings,
    enable_message_ordering: bool,
    endpoint: str | None,
    credentials: Any,
    transport: Transport | Sequence[Transport] | None,
    clock: Clock,
    sync_futures: bool,
    hedge_endpoints: Sequence[str] | None = None,
    hedge_transports: Sequence[Transport | Sequence[Transport]] | None = None,
    channel_pool_size: int | None = None,
    idempotency_attribute: bool | str = False,
    root_certificates: bytes | None = None,
    enable_open_telemetry: bool = False,
    tracer_provider: Any = None,
    meter_provider: Any = None,
) -> _PublisherCore:
    """Check the settings and build a publisher's core from them (the arguments are the client's).

    Raises:
        TypeError, ValueError: a setting of the wrong type, out of range, or settings that clash.
        ImportError: ``enable_open_telemetry`` without the OpenTelemetry API installed.
    """
    for name, value, kind in (
        ("batch_settings", batch_settings, BatchSettings),
        ("retry_settings", retry_settings, RetrySettings),
        ("flow_control", flow_control, FlowControlSettings),
    ):
        if not isinstance(value, kind):
            raise TypeError(f"{name} must be a {kind.__name__}; got {type(value).__name__} {value!r}")
    if hedging_settings is not None and not isinstance(hedging_settings, HedgingSettings):
        raise TypeError(
            f"hedging_settings must be a HedgingSettings or None; got {type(hedging_settings).__name__}"
        )
    check_hedging(hedging_settings, retry_settings)
    delay_source = None
    if hedging_settings is not None and hedging_settings.adaptive_delay is not None:
        delay_source = AdaptiveDelayEstimator(
            hedging_settings.adaptive_delay,
            fallback=hedging_settings.hedge_delay,
            limit=adaptive_delay_limit(retry_settings),
        )
    budget = HedgingBudget(hedging_settings, delay_source)
    flow = FlowController(flow_control)
    if root_certificates is not None and not isinstance(root_certificates, bytes):
        raise TypeError(
            "root_certificates must be PEM bytes (Path(...).read_bytes()); got "
            f"{type(root_certificates).__name__}"
        )
    pool_size = DEFAULT_POOL_SIZE if channel_pool_size is None else check_channel_pool_size(channel_pool_size)
    credentials, refresher, routes = _routes(
        endpoint,
        transport,
        check_hedge_endpoints(hedge_endpoints, hedging_settings is not None),
        hedge_transports,
        hedging_on=hedging_settings is not None,
        credentials=credentials,
        root_certificates=root_certificates,
        pool_size=pool_size,
        clock=clock,
    )
    id_prefix = uuid.uuid4().hex[:16]
    if not enable_open_telemetry and (tracer_provider is not None or meter_provider is not None):
        raise ValueError("tracer_provider and meter_provider need enable_open_telemetry=True")
    telemetry = (
        _telemetry(id_prefix, budget, tracer_provider, meter_provider) if enable_open_telemetry else None
    )
    stats_recorder = StatsRecorder(hedging=hedging_settings is not None)
    observers: list[BatchObserver] = [stats_recorder, routes]
    if telemetry is not None:
        observers.append(telemetry)
    return _PublisherCore(
        hedging=hedging_settings,
        budget=budget,
        batch_settings=batch_settings,
        retry=retry_settings,
        ordering=bool(enable_message_ordering),
        flow=flow,
        routes=routes,
        stats_recorder=stats_recorder,
        sender=BatchSender(
            routes=routes,
            retry=retry_settings,
            hedging=hedging_settings,
            budget=budget,
            clock=clock,
            telemetry=telemetry,
        ),
        observer=BatchObservers(observers),
        telemetry=telemetry,
        clock=clock,
        sync_futures=sync_futures,
        messages=MessagePreparer(
            ordering=bool(enable_message_ordering),
            idempotency_attribute=_idempotency_attribute(idempotency_attribute),
        ),
        id_prefix=id_prefix,
        credentials=credentials,
        refresher=refresher,
    )


def _routes(
    endpoint: str | None,
    transport: Transport | Sequence[Transport] | None,
    hedge_endpoints: tuple[str, ...],
    hedge_transports: Sequence[Transport | Sequence[Transport]] | None,
    *,
    hedging_on: bool,
    credentials: Any,
    root_certificates: bytes | None,
    pool_size: int,
    clock: Clock,
) -> tuple[Any, TokenRefresher | None, EndpointRoutes]:
    """The credentials to use, their token's refresher (``None`` without credentials), and the endpoints:
    the primary, then the hedge endpoints, each a pool of ``pool_size`` connections opened on first use.

    ``transport`` and ``hedge_transports`` are ready-made transports (tests), labelled ``primary``
    and ``hedge-endpoint-N``: one transport, or a sequence of them, each a connection of the endpoint's
    pool. Endpoints given by name are labelled with their ``host:port``.
    """
    if hedge_transports is not None and hedge_endpoints:
        raise ValueError("pass hedge_endpoints or hedge_transports, not both")
    if hedge_transports and not hedging_on:
        raise ValueError("hedge_transports needs hedging: pass hedging_settings=HedgingSettings(...)")
    primary = None if transport is not None else resolve_endpoint(endpoint, credentials=credentials)
    targets = [resolve_endpoint(name, credentials=credentials) for name in hedge_endpoints]
    # (An emulator over TLS, from PUBSUB_EMULATOR_HOST=https://..., takes none, as over plain text.)
    needs_credentials = [t for t in (primary, *targets) if t and t.secure and t.source != EMULATOR_HOST_ENV]
    if credentials is None and needs_credentials:
        # Find Application Default Credentials now, so that a missing setup fails at construction.
        import google.auth

        from hedgepub._transport.grpc import SCOPES

        credentials, _project = google.auth.default(scopes=SCOPES)

    # One refresher for every channel: the pool's connections and the hedge endpoints share each refresh.
    refresher = TokenRefresher(credentials) if credentials is not None else None

    def connect(target: ChannelTarget) -> ConnectionPool:
        def open_connection(_key: int) -> Transport:
            # Each connection of a pool gets a subchannel pool of its own (own_connection), so a new TCP
            # connection, a replacement too; the pool keeps it connected (TCP, TLS) from now on: a hedge
            # is first needed in a stall, the worst moment to pay for a handshake.
            channel = create_channel(
                target,
                credentials,
                root_certificates=root_certificates,
                own_connection=True,
                refresher=refresher,
            )
            return GrpcTransport(channel)

        return ConnectionPool(open_connection, pool_size, clock=clock, description=target.describe())

    def ready(made: Transport | Sequence[Transport]) -> ConnectionPool:
        members = tuple(made) if isinstance(made, Sequence) else (made,)
        return ConnectionPool(ready=members, clock=clock)

    labels = ["primary" if primary is None else primary.target]
    # Without a transport, primary is the target (build_core's callers pass one of the two).
    pools = [ready(transport) if transport is not None else connect(primary)]  # type: ignore[arg-type]
    for number, made in enumerate(hedge_transports or (), start=1):
        labels.append(f"hedge-endpoint-{number}")
        pools.append(ready(made))
    for target in targets:
        labels.append(target.target)
        pools.append(connect(target))
    descriptions = [labels[0] if primary is None else primary.describe()]
    descriptions += labels[1 : 1 + len(hedge_transports or ())]
    descriptions += [target.describe() for target in targets]
    return credentials, refresher, EndpointRoutes(labels, pools, descriptions)


def _telemetry(
    client_id: str, budget: HedgingBudget, tracer_provider: Any, meter_provider: Any
) -> PublisherTelemetry:
    """The OpenTelemetry instrumentation of a publisher (imported only when a client asks for it)."""
    try:
        from hedgepub._publisher.telemetry import PublisherTelemetry
    except ImportError as error:
        raise ImportError(
            f"enable_open_telemetry=True needs the OpenTelemetry API ({error}): pip install 'hedgepub[otel]'"
        ) from error
    return PublisherTelemetry(
        client_id,
        # Weak: the gauges stop reporting a publisher nobody holds any more.
        weakref.WeakMethod(budget.gauge_values),
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
    )


def _idempotency_attribute(value: object) -> str | None:
    """The attribute name to stamp keys in: ``True`` for the default, a name, or ``None`` (off)."""
    if value is False or value is None:
        return None
    if value is True:
        from hedgepub.dedup import IDEMPOTENCY_ATTRIBUTE

        return IDEMPOTENCY_ATTRIBUTE
    if not isinstance(value, str):
        raise TypeError(
            f"idempotency_attribute must be True, False or an attribute name; got {type(value).__name__}"
        )
    if not value or len(value.encode("utf-8")) > 256 or value.startswith("goog"):
        raise ValueError(
            f"idempotency_attribute {value!r} is not a usable attribute key: 1 to 256 bytes, "
            "not starting with 'goog'"
        )
    return value
