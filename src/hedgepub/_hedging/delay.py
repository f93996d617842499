"""Where a batch's hedge delay comes from: a fixed number, or a percentile of recent latency.

:class:`AdaptiveDelayEstimator` keeps recent Publish attempt latencies in a rotating pair of HDR
histograms, as tower's ``hedge`` middleware does: samples go into the current window; when a window's
time is up, it becomes the previous one and a fresh window starts (the one before is forgotten). The
delay is the chosen percentile over both windows, that is over the last one to two windows of traffic,
clamped to ``[0.1 s, limit]`` (``limit``: at most 10 s, and at most half the initial RPC timeout, see
:func:`hedgepub._settings.adaptive_delay_limit`); the fixed delay stands in, as set, until
``min_samples`` are in the two windows. The histograms tell apart latencies from 100 us to 60 s; a
faster or slower attempt is recorded as 100 us or 60 s, which gives the same clamped delay.

Like the token bucket, the estimator is a small in-memory object the pure hedging core is handed: time
comes in as an argument (``now``), nothing here reads a clock, so the rules run on virtual time. It is
used from the publisher's event loop only; ``current`` may be read from any thread.

Which latency is a sample (the engine decides, see :mod:`hedgepub._hedging.engine`): per successful batch, the
latency of the winning attempt, from its sending to its answer, as tower records it. Losers are
cancelled and never answer, so once hedges win, the slow tail they cut short is seen less: the estimate
leans low. That is the stable side to err on. A delay that is too short makes hedges frequent; the token
bucket then runs dry, batches go unhedged, their slow originals are recorded, and the estimate rises
again, so the extra load stays within the bucket's bound (``refill_ratio`` per batch plus its size).
Recording the originals that hedges cut short (as a lower bound of their latency) was tried instead: on a
mix whose slow tier is exactly 5 % (Google's Go test mix), the 95th percentile then sits on the edge
between the tiers and ratchets up into the slow tier, and hedging stops helping.
"""

from __future__ import annotations

from typing import Literal, Protocol

from hdrh.histogram import HdrHistogram

from hedgepub._settings import MIN_ADAPTIVE_DELAY, AdaptiveDelay

# Microseconds from 100 us to one minute, two significant digits (under 1 % error from 6.4 ms up): the
# delay is clamped to [MIN_ADAPTIVE_DELAY, limit], at least 100 ms and at most MAX_ADAPTIVE_DELAY (10 s),
# so finer or wider would only cost memory and time per rotation. A latency outside the range is recorded
# at its edge (:func:`_micros`): it still counts as a sample and in the percentile's rank, and as both
# edges lie far outside the clamp, the delay is the same as if it had been recorded exactly.
_LOWEST_US = 100
_HIGHEST_US = 60_000_000
_SIGNIFICANT_DIGITS = 2
#: The percentile is recomputed at most this many times per window (and at every rotation): a walk over
#: the histograms costs tens of microseconds (see _percentile), too much to repeat for every batch.
_RECOMPUTES_PER_WINDOW = 100


class DelaySource(Protocol):
    """What the hedging core asks for a batch's hedge delay, and tells about a batch's latency."""

    def delay(self, now: float) -> float:
        """The hedge delay, in seconds, for a batch starting at ``now``."""

    def record(self, latency: float, now: float) -> None:
        """A successful batch's attempt latency (seconds), observed at ``now``."""


class AdaptiveDelayEstimator:
    """The hedge delay as a percentile of recent attempt latency (see the module docstring).

    Args:
        settings: percentile, window length and minimum number of samples.
        fallback: the fixed delay used until ``min_samples`` latencies have been recorded.
        limit: the most the delay may be (at least 0.1 s; see
            :func:`hedgepub._settings.adaptive_delay_limit`).
    """

    def __init__(self, settings: AdaptiveDelay, fallback: float, limit: float) -> None:
        if limit < MIN_ADAPTIVE_DELAY:
            raise ValueError(f"limit must be at least {MIN_ADAPTIVE_DELAY:g} s; got {limit!r}")
        self.settings = settings
        self.fallback = fallback
        self.limit = limit
        self._current_window = HdrHistogram(_LOWEST_US, _HIGHEST_US, _SIGNIFICANT_DIGITS)
        self._previous_window = HdrHistogram(_LOWEST_US, _HIGHEST_US, _SIGNIFICANT_DIGITS)
        self._window_start: float | None = None
        self._computed_at: float | None = None
        #: The delay the last batch was given (the fallback until enough samples are in).
        self.current = fallback
        #: Whether ``current`` comes from the histograms (``False``: the fallback).
        self.adapted = False

    def __repr__(self) -> str:
        source = f"p{self.settings.percentile:g}" if self.adapted else "fallback"
        return (
            f"AdaptiveDelayEstimator(delay={self.current:g} s ({source}), samples={self.samples}, "
            f"window={self.settings.window:g} s)"
        )

    @property
    def samples(self) -> int:
        """Latencies in the two windows now."""
        return self._current_window.get_total_count() + self._previous_window.get_total_count()

    def record(self, latency: float, now: float) -> None:
        """Add one attempt latency (seconds) seen at ``now``."""
        self._rotate(now)
        self._current_window.record_value(_micros(latency))

    def delay(self, now: float) -> float:
        """The hedge delay for a batch starting at ``now``: the percentile, clamped, or the fallback."""
        rotated = self._rotate(now)
        recompute_every = self.settings.window / _RECOMPUTES_PER_WINDOW
        if rotated or self._computed_at is None or now - self._computed_at >= recompute_every:
            self._computed_at = now
            self.current, self.adapted = self._compute()
        return self.current

    def _compute(self) -> tuple[float, bool]:
        if self.samples < self.settings.min_samples:
            return self.fallback, False
        seconds = _percentile(self._current_window, self._previous_window, self.settings.percentile) / 1e6
        return min(max(seconds, MIN_ADAPTIVE_DELAY), self.limit), True

    def _rotate(self, now: float) -> bool:
        """Start a new window if the current one's time is up; say whether the windows changed."""
        start = self._window_start
        if start is None:
            self._window_start = now
            return False
        window = self.settings.window
        elapsed = now - start
        if elapsed < window:
            return False
        previous = self._previous_window
        previous.reset()
        if elapsed < 2 * window:
            # The current window becomes the previous one; the old previous one, emptied, is reused.
            self._previous_window, self._current_window = self._current_window, previous
            self._window_start = start + window
        else:
            # Silence for two windows or more: nothing recent is left.
            self._current_window.reset()
            self._window_start = now
        return True


def _micros(latency: float) -> int:
    """A latency in seconds as the histograms record it: whole microseconds within their range."""
    return min(max(round(latency * 1_000_000), _LOWEST_US), _HIGHEST_US)


def _percentile(first: HdrHistogram, second: HdrHistogram, percentile: float) -> int:
    """The ``percentile``-th value over two histograms of the same layout, without merging them."""
    total = first.get_total_count() + second.get_total_count()
    target = max(1, int(percentile * total / 100 + 0.5))
    # The counts are ctypes arrays: read element by element from Python, a walk of their 1,792 buckets
    # took a millisecond. Viewed as integers, whole runs of buckets are summed in C, and only the run
    # that reaches the target is walked.
    ours, theirs = _counts(first), _counts(second)
    seen = 0
    for start in range(0, len(ours), _RUN):
        stop = start + _RUN
        run = sum(ours[start:stop]) + sum(theirs[start:stop])
        if seen + run >= target:
            for index in range(start, min(stop, len(ours))):
                seen += ours[index] + theirs[index]
                if seen >= target:
                    return int(first.get_highest_equivalent_value(first.get_value_from_index(index)))
        seen += run
    return int(max(first.get_max_value(), second.get_max_value()))


#: Buckets summed at a time by :func:`_percentile`.
_RUN = 64
_UNSIGNED: dict[int, Literal["H", "I", "Q"]] = {2: "H", 4: "I", 8: "Q"}


def _counts(histogram: HdrHistogram) -> memoryview:
    """A histogram's bucket counts as integers, read straight from its ctypes array."""
    view = memoryview(histogram.counts)
    return view.cast("B").cast(_UNSIGNED[view.itemsize])
