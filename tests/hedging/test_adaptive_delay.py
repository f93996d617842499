"""The adaptive hedge delay: the estimator's rules, and the engine and publisher using it, on virtual time.

The estimator takes time as an argument, so its windows are tested at exact instants; the engine and the
publisher run many batches on virtual time with latencies from a seeded random mix that shifts midway.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence

import pytest

from hedgepub import AdaptiveDelay, AsyncPublisherClient, HedgingSettings, RetrySettings
from hedgepub._hedging.bucket import TokenBucket
from hedgepub._hedging.delay import AdaptiveDelayEstimator, _micros
from hedgepub._hedging.engine import HedgingCore, SendAttempt, StartTimer, Timer, TimerKind, run_batch
from hedgepub._settings import adaptive_delay_limit
from hedgepub.testing.scripted import ScriptedCall, ScriptedTransport
from hedgepub.testing.virtual_time import run_virtual, virtual_time

TOPIC = "projects/test-project/topics/topic"


def estimator(
    percentile: float = 95.0, window: float = 10.0, min_samples: int = 100, fallback: float = 1.0
) -> AdaptiveDelayEstimator:
    settings = AdaptiveDelay(percentile=percentile, window=window, min_samples=min_samples)
    return AdaptiveDelayEstimator(settings, fallback=fallback, limit=adaptive_delay_limit(RetrySettings()))


def feed(source: AdaptiveDelayEstimator, latencies: Sequence[float], start: float, gap: float) -> float:
    """Record ``latencies`` one every ``gap`` seconds from ``start``; return the time of the last."""
    now = start
    for latency in latencies:
        source.record(latency, now)
        now += gap
    return now - gap


def tiers(count: int, fast: float, slow: float, slow_every: int = 10) -> list[float]:
    """``count`` latencies: every ``slow_every``-th one is ``slow``, the rest ``fast``."""
    return [slow if index % slow_every == 0 else fast for index in range(count)]


# The estimator.


def test_fallback_until_min_samples_then_the_percentile() -> None:
    source = estimator(min_samples=100)
    last = feed(source, tiers(99, fast=0.2, slow=2.0), start=0.0, gap=0.01)
    assert source.delay(last) == 1.0 and not source.adapted
    source.record(0.2, last + 0.01)
    # 1 sample in 10 is 2 s: the 95th percentile is in the slow tier (within the histogram's 1 %).
    assert source.delay(last + 1.0) == pytest.approx(2.0, rel=0.01)
    assert source.adapted and source.current == source.delay(last + 1.0)
    assert "p95" in repr(source)


def test_the_percentile_is_the_one_asked_for() -> None:
    source = estimator(percentile=50, min_samples=10)
    last = feed(source, tiers(100, fast=0.25, slow=2.0), start=0.0, gap=0.01)
    assert source.delay(last) == pytest.approx(0.25, rel=0.01)


def test_clamps_hold_at_both_ends() -> None:
    fast = estimator(min_samples=10)
    last = feed(fast, [0.002] * 50, start=0.0, gap=0.01)
    assert fast.delay(last) == 0.1  # 2 ms latencies: never below the 0.1 s floor
    slow = estimator(min_samples=10)
    last = feed(slow, [30.0] * 50, start=0.0, gap=0.01)
    # Never above half the initial RPC timeout (5 s by default), so a hedge has time to win.
    assert slow.delay(last) == 2.5 == adaptive_delay_limit(RetrySettings())
    small = AdaptiveDelayEstimator(
        AdaptiveDelay(min_samples=1),
        1.0,
        limit=adaptive_delay_limit(RetrySettings(initial_rpc_timeout=60, max_rpc_timeout=60)),
    )
    small.record(45.0, 0.0)
    assert small.delay(0.0) == 10.0  # and never above 10 s, whatever the timeouts


def test_latencies_below_the_histograms_count_at_100_us() -> None:
    # The histograms tell latencies apart from 100 us: faster ones (even 0) are recorded as 100 us.
    assert _micros(0.0) == _micros(1e-6) == _micros(99e-6) == 100
    assert _micros(100e-6) == 100 and _micros(150e-6) == 150
    fast = estimator(min_samples=10)
    last = feed(fast, [0.0, 1e-6, 50e-6, 99e-6] * 5, start=0.0, gap=0.01)
    assert fast.samples == 20
    assert fast.delay(last) == 0.1 and fast.adapted  # the 0.1 s floor, not the fallback
    # Each counts in the percentile's rank: 95 fast of 100 keep p95 fast, 94 let it reach the slow tier.
    for fast_count, expected in ((95, 0.1), (94, 0.5)):
        source = estimator(min_samples=100)
        last = feed(source, [20e-6] * fast_count + [0.5] * (100 - fast_count), start=0.0, gap=0.01)
        assert source.delay(last) == pytest.approx(expected, rel=0.01)


def test_latencies_above_the_histograms_count_at_60_s() -> None:
    assert _micros(60.0) == _micros(61.0) == _micros(3600.0) == 60_000_000
    limit = adaptive_delay_limit(RetrySettings(initial_rpc_timeout=60, max_rpc_timeout=60))
    assert limit == 10.0
    for slow_count, expected in ((5, 0.2), (6, 10.0)):
        source = AdaptiveDelayEstimator(AdaptiveDelay(min_samples=100), fallback=1.0, limit=limit)
        slow = [(61.0, 120.0, 3600.0)[index % 3] for index in range(slow_count)]
        last = feed(source, [0.2] * (100 - slow_count) + slow, start=0.0, gap=0.01)
        assert source.samples == 100
        # p95 is the 95th of 100: the slow ones count in the rank, and the delay never passes the limit.
        assert source.delay(last) == pytest.approx(expected, rel=0.01)


def test_the_floor_is_exactly_0_1_s() -> None:
    for latency in (0.001, 0.05, 0.098):
        source = estimator(min_samples=10)
        last = feed(source, [latency] * 20, start=0.0, gap=0.01)
        assert source.delay(last) == 0.1
    at_floor = estimator(min_samples=10)
    last = feed(at_floor, [0.1] * 20, start=0.0, gap=0.01)
    # The percentile is the top of the histogram's bucket holding 100 ms: a little above, within 1 %.
    assert 0.1 <= at_floor.delay(last) <= 0.101


def test_the_limit_is_half_an_initial_rpc_timeout_below_the_10_s_cap() -> None:
    settings = AdaptiveDelay(min_samples=10)
    # Latencies shorter than the 0.5 s initial RPC timeout but longer than half of it: the delay is 0.25 s,
    # so a hedge sent then still has half the timeout to win.
    half = AdaptiveDelayEstimator(
        settings, fallback=0.3, limit=adaptive_delay_limit(RetrySettings(initial_rpc_timeout=0.5))
    )
    assert half.limit == 0.25
    # Until min_samples are in, the fixed delay stands in as set (check_hedging keeps it under the timeout).
    assert half.delay(0.0) == 0.3 and not half.adapted
    last = feed(half, [0.4] * 10, start=0.0, gap=0.01)
    assert half.delay(last + 1.0) == 0.25 and half.adapted
    below = AdaptiveDelayEstimator(settings, fallback=0.3, limit=0.25)
    last = feed(below, [0.2] * 10, start=0.0, gap=0.01)
    assert below.delay(last) == pytest.approx(0.2, rel=0.01)
    # A 0.2 s initial RPC timeout leaves only the floor: the limit is 0.1 s, whatever the latency.
    pinned = AdaptiveDelayEstimator(
        settings, fallback=0.1, limit=adaptive_delay_limit(RetrySettings(initial_rpc_timeout=0.2))
    )
    assert pinned.limit == 0.1
    last = feed(pinned, [0.02, 5.0] * 5, start=0.0, gap=0.01)
    assert pinned.delay(last) == 0.1
    with pytest.raises(ValueError, match=r"limit must be at least 0\.1 s"):
        AdaptiveDelayEstimator(
            settings, fallback=0.1, limit=adaptive_delay_limit(RetrySettings(initial_rpc_timeout=0.19))
        )


def test_a_shifting_distribution_moves_the_delay_within_two_windows() -> None:
    source = estimator(window=10.0, min_samples=50)
    # 10 s of fast traffic (p95 ~ 0.15 s), then slower traffic whose p95 is 0.8 s.
    last = feed(source, tiers(1000, fast=0.15, slow=0.15), start=0.0, gap=0.01)
    assert source.delay(last) == pytest.approx(0.15, rel=0.01)
    delays = []
    now = last
    for second in range(1, 31):
        now = feed(source, tiers(100, fast=0.3, slow=0.8), start=last + second - 1 + 0.01, gap=0.01)
        delays.append(source.delay(now))
    # The delay never goes back down, and after two windows the old traffic is forgotten entirely.
    assert delays == sorted(delays)
    assert delays[-1] == pytest.approx(0.8, rel=0.01)
    assert delays[20] == delays[-1]


def test_silence_for_two_windows_forgets_everything() -> None:
    source = estimator(window=5.0, min_samples=20)
    last = feed(source, [0.4] * 100, start=0.0, gap=0.01)
    assert source.delay(last) == pytest.approx(0.4, rel=0.01)
    assert source.delay(last + 10.0) == 1.0 and not source.adapted
    assert source.samples == 0


def test_recomputed_at_most_a_hundred_times_a_window() -> None:
    source = estimator(window=10.0, min_samples=1)
    source.record(0.3, 0.0)
    assert source.delay(0.0) == pytest.approx(0.3, rel=0.01)
    source.record(2.0, 0.01)
    source.record(2.0, 0.02)
    assert source.delay(0.05) == pytest.approx(0.3, rel=0.01)  # within window / 100 of the last
    assert source.delay(0.1) == pytest.approx(2.0, rel=0.01)


# The engine: the delay is an input, read once per batch; the latency goes back on success.


def test_core_reads_the_delay_once_at_start_and_records_the_winner() -> None:
    source = estimator(min_samples=1)
    source.record(0.4, 0.0)
    core = HedgingCore(1, RetrySettings(), HedgingSettings(), TokenBucket(1, 1.0), source)
    actions = core.start(1.0)
    assert StartTimer(Timer(TimerKind.HEDGE, 1), pytest.approx(0.4, rel=0.01)) in actions
    assert core.hedge_delay == source.current
    resolve = core.attempt_succeeded(0, ["id"], 1.25)[-1]
    assert resolve.outcome.hedge_delay == core.hedge_delay  # type: ignore[union-attr]
    assert source.samples == 2


def test_core_records_the_winning_hedge_own_latency() -> None:
    source = estimator(min_samples=1, percentile=99)
    source.record(0.2, 0.0)
    bucket = TokenBucket(1, 1.0)
    bucket.refill()
    core = HedgingCore(1, RetrySettings(), HedgingSettings(), bucket, source)
    core.start(0.0)
    sent_at = core.hedge_delay
    assert sent_at == pytest.approx(0.2, rel=0.01)
    assert SendAttempt(1, 1, 10.0) in core.timer_fired(Timer(TimerKind.HEDGE, 1), sent_at)
    core.attempt_succeeded(1, ["id"], sent_at + 0.7)
    # The hedge answered 0.7 s after it was sent; the cancelled original is never a sample.
    assert source.samples == 2
    assert source.delay(2.0) == pytest.approx(0.7, rel=0.01)


async def _batches(
    latencies: Sequence[float], source: AdaptiveDelayEstimator, bucket: TokenBucket, gap: float
) -> tuple[list[float], int]:
    """Run one batch per latency (each attempt of that batch takes it, hedges 5 ms), ``gap`` apart."""
    delays: list[float] = []
    hedges = 0
    hedging = HedgingSettings(hedge_delay=1.0, adaptive_delay=source.settings)
    loop = asyncio.get_running_loop()

    async def one(latency: float) -> None:
        nonlocal hedges

        async def attempt(number: int, timeout: float) -> list[str]:
            await asyncio.sleep(latency if number == 0 else 0.005)
            return ["id"]

        outcome = await run_batch(
            attempt,
            message_count=1,
            retry=RetrySettings(),
            hedging=hedging,
            bucket=bucket,
            delay_source=source,
        )
        assert outcome.ok and outcome.hedge_delay is not None
        delays.append(outcome.hedge_delay)
        hedges += outcome.hedges_sent

    tasks = []
    start = loop.time()
    for index, latency in enumerate(latencies):
        await asyncio.sleep(max(0.0, start + index * gap - loop.time()))
        tasks.append(asyncio.create_task(one(latency)))
    await asyncio.gather(*tasks)
    return delays, hedges


def mix(rng: random.Random, count: int, fast: float, slow: float, slow_share: float) -> list[float]:
    return [slow if rng.random() < slow_share else fast for _ in range(count)]


def test_engine_follows_a_shifting_mix_and_the_bucket_still_caps_hedges() -> None:
    rng = random.Random(7)
    source = estimator(window=5.0, min_samples=50)
    bucket = TokenBucket(5, 0.1)
    # 20 batches/s: 30 s of a fast mix (2 % at 2 s), then 30 s where every attempt takes 0.6 s or 3 s.
    first = mix(rng, 600, fast=0.02, slow=2.0, slow_share=0.02)
    second = mix(rng, 600, fast=0.6, slow=3.0, slow_share=0.02)
    delays, hedges = run_virtual(_batches(first + second, source, bucket, gap=0.05))
    assert delays[:40] == [1.0] * 40  # the fallback until 50 samples were in
    assert all(delay == 0.1 for delay in delays[100:600])  # the fast mix: the floor
    assert delays[-1] == pytest.approx(0.6, rel=0.01)  # the slow mix's 95th percentile
    assert all(0.1 <= delay <= 2.5 for delay in delays)
    # Every batch refills 0.1 token and the bucket holds at most 5: hedges <= 0.1 * batches + 5.
    assert hedges <= 0.1 * len(delays) + 5


# The publisher: stats() reports the delay in use.


@virtual_time
async def test_publisher_stats_report_the_adaptive_delay() -> None:
    transport = ScriptedTransport()

    async def step(call: ScriptedCall) -> list[str]:
        await asyncio.sleep(0.3)
        return transport.next_ids(len(call.request.messages))

    transport.default = step
    hedging = HedgingSettings(hedge_delay=1.0, adaptive_delay=AdaptiveDelay(min_samples=5, window=60))
    publisher = AsyncPublisherClient(hedging_settings=hedging, transport=transport)
    assert publisher.stats().hedge_delay_ms == 1000.0
    for _ in range(8):
        await publisher.publish(TOPIC, b"x")
    assert publisher.stats().hedge_delay_ms == pytest.approx(300.0, rel=0.01)
    await publisher.shutdown()
    fixed = AsyncPublisherClient(hedging_settings=HedgingSettings(hedge_delay=0.25), transport=transport)
    assert fixed.stats().hedge_delay_ms == 250.0
    assert AsyncPublisherClient(transport=transport).stats().hedge_delay_ms == 0.0
