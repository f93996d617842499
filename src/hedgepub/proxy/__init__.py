"""``hedgepub proxy``: a local gRPC endpoint that gives Publish hedging to every language's Pub/Sub client.

A client points ``PUBSUB_EMULATOR_HOST`` (or its endpoint setting) at the proxy; the proxy forwards every
``google.pubsub.v1`` RPC (and IAMPolicy's) to its upstream, Google Cloud Pub/Sub or any endpoint, and
sends each Publish through hedgepub's publisher core: per-topic token buckets, the hedge delay (fixed or
adaptive), hedge endpoints, the connection pool, the client-telemetry header; a request with an
ordering key is never hedged. Everything else (admin calls, Pull, StreamingPull, acks) goes as bytes.

From Python::

    from hedgepub import HedgingSettings
    from hedgepub.proxy import Proxy

    with Proxy("google", hedging_settings=HedgingSettings(hedge_delay=0.1)) as proxy:
        os.environ["PUBSUB_EMULATOR_HOST"] = proxy.address   # 127.0.0.1:<ephemeral port>
        ...
        proxy.stats()   # the forwarded publishes: attempts, hedges sent and won, percentiles

or on a loop you run, ``async with AsyncProxy(...)``; from a shell, ``hedgepub proxy --upstream google``.
It needs the base install only (no extra). The handler is :mod:`._forwarder`; the proxy's life is
:mod:`._proxy`; docs/proxy.md is the user's guide.
"""

from hedgepub.proxy._forwarder import REQUEST_LOG, InFlightBytes
from hedgepub.proxy._proxy import DEFAULT_MAX_IN_FLIGHT_BYTES, AsyncProxy, Proxy, upstream_target

__all__ = [
    "DEFAULT_MAX_IN_FLIGHT_BYTES",
    "REQUEST_LOG",
    "AsyncProxy",
    "InFlightBytes",
    "Proxy",
    "upstream_target",
]
