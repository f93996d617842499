"""What the batches of one publisher share for hedging: a token bucket per topic, and the hedge delay.

Each topic has a bucket of its own (docs/hedging.md, rule 13), as each of Google's clients has one per
publisher, and their publishers are per topic: a topic whose publishes stall spends its own tokens, never
those of the other topics the same client publishes to. Every bucket is sized by the same settings and
starts empty when the topic's first batch is sent. The hedge delay source (the adaptive delay) is shared:
it measures the service, which every topic reaches the same way.
"""

from __future__ import annotations

import threading

from hedgepub._hedging.bucket import TokenBucket
from hedgepub._hedging.delay import AdaptiveDelayEstimator
from hedgepub._settings import HedgingSettings


class HedgingBudget:
    """The token buckets batches spend on hedges, by topic, and where their hedge delay comes from.

    Args:
        settings: the publisher's hedging settings; ``None`` when hedging is off (no bucket, no delay).
        delay_source: the adaptive delay estimator, or ``None`` for ``settings.hedge_delay``.
    """

    def __init__(
        self, settings: HedgingSettings | None, delay_source: AdaptiveDelayEstimator | None = None
    ) -> None:
        self.settings = settings
        self.delay_source = delay_source
        self._buckets: dict[str, TokenBucket] = {}
        self._lock = threading.Lock()

    def bucket_for(self, topic: str) -> TokenBucket | None:
        """The bucket the batches of ``topic`` spend and refill, made empty on first use (``None`` without
        hedging)."""
        if self.settings is None:
            return None
        bucket = self._buckets.get(topic)
        if bucket is None:
            with self._lock:
                bucket = self._buckets.get(topic)
                if bucket is None:
                    bucket = self._buckets[topic] = TokenBucket.from_settings(self.settings)
        return bucket

    def tokens_by_topic(self) -> dict[str, float]:
        """Each topic's tokens now, for the topics that have sent a batch (any thread), as a new plain
        dict (a stats snapshot holds it, and ``dataclasses.asdict`` copies it)."""
        with self._lock:
            buckets = list(self._buckets.items())
        return {topic: bucket.tokens for topic, bucket in buckets}

    @property
    def tokens(self) -> float:
        """Tokens available now in every topic's bucket together (0.0 without hedging)."""
        with self._lock:
            buckets = list(self._buckets.values())
        return sum(bucket.tokens for bucket in buckets)

    @property
    def hedge_delay(self) -> float:
        """The hedge delay now, in seconds: the fixed one or the adaptive one (0.0 without hedging)."""
        if self.settings is None:
            return 0.0
        return self.settings.hedge_delay if self.delay_source is None else self.delay_source.current

    def gauge_values(self) -> tuple[float, float]:
        """(tokens of every topic together, hedge delay in seconds) now, for the OpenTelemetry gauges."""
        return self.tokens, self.hedge_delay
