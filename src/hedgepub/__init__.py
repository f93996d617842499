"""hedgepub: publish to Google Cloud Pub/Sub with hedging, to cut the tail latency of slow publishes.

The whole public API is listed here; everything in a module whose name starts with ``_`` is private.
"""

# First, before any module imports grpc: keep gRPC's C-core log lines off the terminal by default.
from hedgepub._transport import grpc_logging  # noqa: F401

# isort: split
from hedgepub._exceptions import (
    FlowControlLimitError,
    HedgepubError,
    OrderingKeyPausedError,
    PublishError,
    PublishManyError,
    PublishTimeoutError,
    ResponseMismatchError,
    RpcError,
    ShutdownTimeoutError,
)
from hedgepub._publisher.client import AsyncPublisherClient, PublisherClient
from hedgepub._publisher.stats import ConnectionStats, EndpointStats, PublisherStats
from hedgepub._settings import (
    AdaptiveDelay,
    BatchSettings,
    FlowControlSettings,
    HedgingSettings,
    LimitExceededBehavior,
    RetrySettings,
    check_hedging,
)
from hedgepub._status import StatusCode
from hedgepub._version import __version__ as __version__
from hedgepub.dedup import Deduplicator, DedupStats

__all__ = [
    "AdaptiveDelay",
    "AsyncPublisherClient",
    "BatchSettings",
    "ConnectionStats",
    "DedupStats",
    "Deduplicator",
    "EndpointStats",
    "FlowControlLimitError",
    "FlowControlSettings",
    "HedgepubError",
    "HedgingSettings",
    "LimitExceededBehavior",
    "OrderingKeyPausedError",
    "PublishError",
    "PublishManyError",
    "PublishTimeoutError",
    "PublisherClient",
    "PublisherStats",
    "ResponseMismatchError",
    "RetrySettings",
    "RpcError",
    "ShutdownTimeoutError",
    "StatusCode",
    "check_hedging",
]
