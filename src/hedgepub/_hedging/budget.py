"""What the batches of one publisher share for hedging: the token bucket and the hedge delay."""

from __future__ import annotations

from hedgepub._hedging.bucket import TokenBucket
from hedgepub._hedging.delay import AdaptiveDelayEstimator
from hedgepub._settings import HedgingSettings


class HedgingBudget:
    """The token bucket batches spend on hedges, and where their hedge delay comes from.

    Args:
        settings: the publisher's hedging settings; ``None`` when hedging is off (no bucket, no delay).
        delay_source: the adaptive delay estimator, or ``None`` for ``settings.hedge_delay``.
    """

    def __init__(
        self, settings: HedgingSettings | None, delay_source: AdaptiveDelayEstimator | None = None
    ) -> None:
        self.settings = settings
        self.delay_source = delay_source
        self.bucket = TokenBucket.from_settings(settings) if settings is not None else None

    def bucket_for(self, topic: str) -> TokenBucket | None:
        """The bucket the batches of ``topic`` spend and refill (``None`` without hedging)."""
        return self.bucket

    @property
    def tokens(self) -> float:
        """Tokens available now (0.0 without hedging)."""
        return 0.0 if self.bucket is None else self.bucket.tokens

    @property
    def hedge_delay(self) -> float:
        """The hedge delay now, in seconds: the fixed one or the adaptive one (0.0 without hedging)."""
        if self.settings is None:
            return 0.0
        return self.settings.hedge_delay if self.delay_source is None else self.delay_source.current

    def gauge_values(self) -> tuple[float, float]:
        """(tokens, hedge delay in seconds) now, for the OpenTelemetry gauges (any thread)."""
        return self.tokens, self.hedge_delay
