"""``hedgepub advise``'s replay driver: the same decisions as a publisher's asyncio driver, in bounded memory.

The replay runs the engine's decision core (:class:`~hedgepub._hedging.engine.HedgingCore`) as a
discrete-event simulation of its own. These tests hold it to the driver every publisher runs
(:func:`~hedgepub._hedging.engine.run_batch` on asyncio, here on the virtual-time loop), batch for batch:
the same latencies, attempts, hedges and winners, for fixed and adaptive delays, retries after attempt
timeouts, both latency models and both ways of settling a batch (with its core, or at once when its
original answers before any of its timers).
"""

from __future__ import annotations

import asyncio
import random
import tracemalloc
from collections.abc import Sequence
from typing import Any

import pytest

from hedgepub import AdaptiveDelay, HedgingSettings, RetrySettings
from hedgepub._hedging.bucket import TokenBucket
from hedgepub._hedging.delay import AdaptiveDelayEstimator, _percentile
from hedgepub._hedging.engine import BatchOutcome, run_batch
from hedgepub._settings import adaptive_delay_limit
from hedgepub.bench import LatencySamples, replay
from hedgepub.bench._advise import _LatencySource, _replay_events
from hedgepub.testing.virtual_time import run_virtual


def _asyncio_replay(
    source: _LatencySource, hedging: HedgingSettings | None, retry: RetrySettings, passes: int
) -> list[BatchOutcome]:
    """The replay as every publisher drives the core: run_batch per batch, on the virtual-time loop."""

    async def play() -> list[BatchOutcome]:
        loop = asyncio.get_running_loop()
        bucket = TokenBucket.from_settings(hedging) if hedging is not None else None
        if bucket is not None:
            for _ in range(round(bucket.max_tokens / bucket.refill_ratio)):
                bucket.refill()
        delay = None
        if hedging is not None and hedging.adaptive_delay is not None:
            delay = AdaptiveDelayEstimator(
                hedging.adaptive_delay, fallback=hedging.hedge_delay, limit=adaptive_delay_limit(retry)
            )
        arrivals = source.arrivals
        period = arrivals[-1] + arrivals[-1] / (len(arrivals) - 1)

        async def one(index: int, pass_start: float) -> BatchOutcome:
            first = True

            async def attempt(attempt_number: int, timeout: float) -> Sequence[str]:
                nonlocal first
                if attempt_number == 0 and first:
                    first = False
                    latency = source.originals[index]
                else:
                    latency = source.other(index, loop.time() - pass_start)
                await asyncio.sleep(latency)
                return ("0",)

            await asyncio.sleep(max(0.0, pass_start + arrivals[index] - loop.time()))
            return await run_batch(
                attempt,
                message_count=1,
                retry=retry,
                hedging=hedging,
                bucket=bucket,
                delay_source=delay,
            )

        batches = [one(i, n * period) for n in range(passes) for i in range(len(arrivals))]
        return list((await asyncio.gather(*batches))[-len(arrivals) :])

    return run_virtual(play())


def _samples(count: int, seed: int, timed: bool) -> LatencySamples:
    """Latencies drawn continuously (no two alike, so no two events tie): mostly fast, a slow tail
    of 0.2-1 s, and some beyond the first attempt's 5 s timeout (retried)."""
    rng = random.Random(seed)
    latencies, sent, now = [], [], 0.0
    for _ in range(count):
        draw = rng.random()
        if draw < 0.01:
            latencies.append(rng.uniform(5.5, 7.0))
        elif draw < 0.07:
            latencies.append(rng.uniform(0.2, 1.0))
        else:
            latencies.append(rng.uniform(0.002, 0.02))
        sent.append(now)
        now += rng.expovariate(40.0)
    return LatencySamples(tuple(latencies), tuple(sent) if timed else None, "drawn")


SETTINGS: dict[str, HedgingSettings | None] = {
    "unhedged": None,
    "fixed": HedgingSettings(hedge_delay=0.1, max_tokens=10, refill_ratio=0.05),
    "fixed-rich": HedgingSettings(hedge_delay=0.15, max_tokens=250, refill_ratio=0.2),
    "adaptive": HedgingSettings(max_tokens=50, refill_ratio=0.1, adaptive_delay=AdaptiveDelay(90)),
}


@pytest.mark.parametrize("model", ["trace", "independent"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_replay_decides_as_the_publishers_driver(name: str, model: str) -> None:
    hedging = SETTINGS[name]
    retry = RetrySettings()
    samples = _samples(1500, seed=7, timed=model == "trace")
    expected = _asyncio_replay(_LatencySource(samples, model, 40.0, 1), hedging, retry, passes=2)
    ok = [o for o in expected if o.ok]
    assert len(ok) == 1500 and sum(o.attempts_sent for o in expected) > 1500  # retries and hedges were in it
    for shortcut in (True, False):
        tally = _replay_events(
            _LatencySource(samples, model, 40.0, 1), hedging, retry, True, 2, shortcut=shortcut
        )
        assert sorted(tally.latencies_ms) == pytest.approx(sorted(o.latency * 1000 for o in ok), abs=1e-9)
        assert tally.attempts == sum(o.attempts_sent for o in expected)
        assert tally.hedges_sent == sum(o.hedges_sent for o in expected)
        assert tally.hedges_won == sum(o.hedge_won for o in expected)
        assert (tally.publishes, tally.failed) == (1500, 0)


def test_the_replay_holds_only_the_batches_in_flight() -> None:
    # 40,000 publishes a pass at 40/s: a few are in flight at a time. The replay once queued every
    # batch of every pass as a coroutine up front (about 80 MB here); now memory follows the
    # concurrency, plus the reported pass's latencies (8 bytes each).
    samples = _samples(40_000, seed=3, timed=True)
    hedging = HedgingSettings(hedge_delay=0.1, max_tokens=50, refill_ratio=0.1)
    tracemalloc.start()
    try:
        prediction = replay(samples, hedging)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert prediction.publishes == 40_000 and prediction.hedges_sent > 0
    assert peak < 8_000_000, f"the replay of 2 x 40,000 publishes peaked at {peak:,} bytes"


def test_the_adaptive_percentile_is_the_walk_over_both_windows() -> None:
    # _percentile sums runs of buckets at a time: it must give the bucket a plain walk gives
    estimator = AdaptiveDelayEstimator(AdaptiveDelay(95), fallback=0.1, limit=2.5)
    rng = random.Random(11)
    for _ in range(5000):
        estimator.record(rng.lognormvariate(-4, 1.5), 0.0)
    current, previous = estimator._current_window, estimator._previous_window
    for _ in range(3000):
        previous.record_value(rng.randint(100, 60_000_000))

    def walk(percentile: float) -> Any:
        total = current.get_total_count() + previous.get_total_count()
        target = max(1, int(percentile * total / 100 + 0.5))
        seen = 0
        for index, (a, b) in enumerate(zip(current.counts, previous.counts, strict=True)):
            seen += a + b
            if seen >= target:
                return current.get_highest_equivalent_value(current.get_value_from_index(index))
        return None

    for percentile in (0.0, 1.0, 50.0, 90.0, 95.0, 99.0, 99.9, 100.0):
        assert _percentile(current, previous, percentile) == walk(percentile)
