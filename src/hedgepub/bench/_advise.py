"""``hedgepub advise``: predict what hedging settings would do, from latencies measured without them.

The measured latencies come from a bench ``results.json`` (its per-publish samples), a CSV of per-publish
latencies, a Cloud Monitoring export of ``pubsub.googleapis.com/topic/send_request_latencies`` (a
``timeSeries`` list whose points hold a ``distributionValue``) or an OpenTelemetry metrics export of
hedgepub's own ``hedgepub.publish.latency`` histogram (OTLP JSON, or the Python SDK's ``to_json``),
read by :mod:`hedgepub.bench._latencies`.

They are replayed through hedgepub's own hedging engine (the decision core
:class:`hedgepub._hedging.engine.HedgingCore` every publisher runs, with its token bucket and adaptive
delay) on virtual time, by a discrete-event driver of its own (:func:`_replay_events`, held to the
publishers' asyncio driver batch for batch by the tests): each recorded publish starts a batch at its
moment, and every attempt the engine sends (the original, its retries, each hedge) waits a latency taken
from the measurements. Which latency an attempt gets depends on what the measurements say about time:

* ``trace`` (per-publish samples with send times: a bench run or a CSV with ``sent_at_s``): the
  original gets the latency recorded for that publish; a hedge or retry sent at time ``t`` gets the
  latency of the recorded publish sent closest to ``t`` (never the batch's own). Slowness that is
  correlated in time (a stall window, a slow minute) therefore reaches the hedges too, as it would.
* ``independent`` (a distribution, or samples without send times): originals follow an open-loop Poisson
  schedule at ``rate`` and every attempt draws its latency independently from the measured distribution.

A latency longer than the attempt's timeout is cut by the engine as it would be (a ``DEADLINE_EXCEEDED``
and a retry). Each candidate starts with a full token bucket (a publisher past its first few hundred
batches) and the schedule is played twice, the second pass right after the first with the bucket and
adaptive delay as the first left them; only the second is reported, so that a short measurement does not
let the bucket's initial tokens stand in for what its refill ratio can pay for in the long run.
``extra_rpcs`` is RPCs sent per publish minus one.
"""

from __future__ import annotations

import bisect
import heapq
import json
import math
import random
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from hedgepub._settings import AdaptiveDelay, HedgingSettings, RetrySettings, adaptive_delay_limit
from hedgepub.bench._latencies import LatencySamples

#: How replayed attempts get their latencies (see the module docstring).
Model = Literal["auto", "trace", "independent"]
MODELS: tuple[str, ...] = ("auto", "trace", "independent")
#: Publishes per second of the independent model's schedule when the input gives no rate.
DEFAULT_RATE = 40.0

#: The grid ``advise`` searches by default: fixed delays (s), adaptive percentiles, tokens and refills.
DEFAULT_DELAYS: tuple[float, ...] = (0.1, 0.2, 0.3, 0.5, 1.0, 2.0)
DEFAULT_PERCENTILES: tuple[float, ...] = (90.0, 95.0, 99.0)
DEFAULT_TOKENS: tuple[int, ...] = (10, 50, 250)
DEFAULT_REFILLS: tuple[float, ...] = (0.01, 0.05, 0.1, 0.2)


# ---- candidates and the replay --------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """One setting to predict: a name and the hedging settings (``None``: unhedged)."""

    name: str
    hedging: HedgingSettings | None

    @property
    def delay_text(self) -> str:
        """The delay as shown: ``100 ms`` or ``adaptive p95``."""
        if self.hedging is None:
            return "-"
        if self.hedging.adaptive_delay is not None:
            return f"adaptive p{self.hedging.adaptive_delay.percentile:g}"
        return f"{self.hedging.hedge_delay * 1000:g} ms"


def candidate(hedging: HedgingSettings | None) -> Candidate:
    """The candidate of ``hedging`` with its name, e.g. ``fixed-100ms/50/0.1`` or ``adaptive-p95/50/0.1``."""
    if hedging is None:
        return Candidate("unhedged", None)
    bucket = f"{hedging.max_tokens}/{hedging.refill_ratio:g}"
    if hedging.adaptive_delay is not None:
        return Candidate(f"adaptive-p{hedging.adaptive_delay.percentile:g}/{bucket}", hedging)
    return Candidate(f"fixed-{hedging.hedge_delay * 1000:g}ms/{bucket}", hedging)


def grid(
    delays: Iterable[float] = DEFAULT_DELAYS,
    percentiles: Iterable[float] = DEFAULT_PERCENTILES,
    tokens: Iterable[int] = DEFAULT_TOKENS,
    refills: Iterable[float] = DEFAULT_REFILLS,
) -> list[Candidate]:
    """Unhedged, then every fixed delay and adaptive percentile with every token count and refill ratio.

    Raises ``ValueError`` (from :class:`~hedgepub.HedgingSettings`) for a value out of its range.
    """
    tokens, refills = list(tokens), list(refills)
    found = [candidate(None)]
    for delay in delays:
        found += [candidate(HedgingSettings(delay, t, r)) for t in tokens for r in refills]
    for percentile in percentiles:
        found += [
            candidate(HedgingSettings(max_tokens=t, refill_ratio=r, adaptive_delay=AdaptiveDelay(percentile)))
            for t in tokens
            for r in refills
        ]
    return found


@dataclass(frozen=True)
class Prediction:
    """What the replay predicts for one candidate."""

    name: str
    delay: str
    max_tokens: int | None
    refill_ratio: float | None
    p50_ms: float
    p99_ms: float
    p999_ms: float
    max_ms: float
    #: RPCs sent per publish beyond the first (hedges and retries).
    extra_rpcs: float
    hedges_sent: int
    hedges_won: int
    publishes: int
    failed: int

    def to_dict(self) -> dict[str, Any]:
        """For ``advice.json``: floats rounded to 0.001."""
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}


def _percentile(ordered: Sequence[float], percentile: float) -> float:
    """The value at ``percentile`` (nearest rank, as the bench's histograms report it)."""
    if not ordered:
        return math.nan
    rank = max(1, math.ceil(percentile / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


class _LatencySource:
    """Which latency each replayed attempt waits (see the module docstring)."""

    def __init__(self, samples: LatencySamples, model: Model, rate: float, seed: int) -> None:
        self._rng = random.Random(seed)
        latencies = list(samples.latencies_s)
        if model == "auto":
            model = "trace" if samples.sent_at_s is not None and len(latencies) > 1 else "independent"
        if model == "trace" and (samples.sent_at_s is None or len(latencies) < 2):
            raise ValueError(
                "the trace model needs per-publish send times (a bench run, or sent_at_s in a CSV)"
            )
        self.model = model
        if model == "trace":
            sent_at = samples.sent_at_s
            assert sent_at is not None
            order = sorted(range(len(latencies)), key=lambda i: sent_at[i])
            first = sent_at[order[0]]
            self.arrivals = [sent_at[i] - first for i in order]
            self.originals = [latencies[i] for i in order]
        else:
            self.originals = latencies[:]
            self._rng.shuffle(self.originals)
            now, self.arrivals = 0.0, []
            for _ in self.originals:
                self.arrivals.append(now)
                now += self._rng.expovariate(rate)
        self._pool = latencies

    def other(self, index: int, at: float) -> float:
        """The latency of an attempt of batch ``index`` (not its original's first try) sent at ``at``."""
        if self.model == "independent":
            return self._rng.choice(self._pool)
        arrivals = self.arrivals
        position = bisect.bisect_left(arrivals, at)
        best, best_gap = None, math.inf
        for neighbour in (position - 2, position - 1, position, position + 1):
            if 0 <= neighbour < len(arrivals) and neighbour != index:
                gap = abs(arrivals[neighbour] - at)
                if gap < best_gap:
                    best, best_gap = neighbour, gap
        assert best is not None
        return self.originals[best]


def replay(
    samples: LatencySamples,
    hedging: HedgingSettings | None,
    *,
    retry: RetrySettings | None = None,
    model: Model = "auto",
    rate: float | None = None,
    seed: int = 1,
    full_bucket: bool = True,
    passes: int = 2,
    name: str | None = None,
    initial_tokens: float | None = None,
    initial_delay: tuple[float, int] | None = None,
) -> Prediction:
    """Replay ``samples`` through the hedging engine with ``hedging``, on virtual time; see the module.

    ``passes`` plays the schedule that many times in a row and reports the last one only. The bucket
    starts full, or empty without ``full_bucket``, or with ``initial_tokens`` when given (what a bench
    run's publisher had: ``config.run.tokens_at_start`` of its ``results.json``). ``initial_delay``
    ``(seconds, count)`` gives an adaptive delay a history: ``count`` latencies of ``seconds`` recorded
    at the start, as a bench run's warm-up left its estimator (``config.run.hedge_delay_at_start_ms``
    and ``config.warmup_publishes``); they age out of its windows as the live ones did.
    """
    retry = retry or RetrySettings()
    source = _LatencySource(samples, model, rate or samples.rate() or DEFAULT_RATE, seed)
    tally = _replay_events(source, hedging, retry, full_bucket, passes, initial_tokens, initial_delay)
    latencies = sorted(tally.latencies_ms)
    chosen = candidate(hedging)
    return Prediction(
        name=name or chosen.name,
        delay=chosen.delay_text,
        max_tokens=hedging.max_tokens if hedging else None,
        refill_ratio=hedging.refill_ratio if hedging else None,
        p50_ms=_percentile(latencies, 50.0),
        p99_ms=_percentile(latencies, 99.0),
        p999_ms=_percentile(latencies, 99.9),
        max_ms=latencies[-1] if latencies else math.nan,
        extra_rpcs=tally.attempts / tally.publishes - 1.0,
        hedges_sent=tally.hedges_sent,
        hedges_won=tally.hedges_won,
        publishes=tally.publishes,
        failed=tally.failed,
    )


@dataclass
class _Tally:
    """What the reported pass of a replay did."""

    latencies_ms: array[float] = field(default_factory=lambda: array("d"))
    attempts: int = 0
    hedges_sent: int = 0
    hedges_won: int = 0
    publishes: int = 0
    failed: int = 0


class _Batch:
    """One replayed batch: its engine core and what its driver keeps (due timers, attempts running)."""

    __slots__ = ("core", "due", "first", "index", "pass_start", "reported", "running")

    def __init__(self, core: Any, index: int, pass_start: float, reported: bool) -> None:
        self.core = core
        self.index = index
        self.pass_start = pass_start
        #: The original's first try is still to be sent (it gets the batch's own recorded latency).
        self.first = True
        #: When each of the core's running timers is due.
        self.due: dict[Any, float] = {}
        #: The attempts in flight, by attempt id.
        self.running: set[int] = set()
        self.reported = reported


# What a queued event is: the answer of a batch settled without its core (see settled_at_once), an
# attempt's answer, one of the core's timers.
_SETTLED, _ANSWER, _TIMER = 0, 1, 2
_IDS = ("0",)


def _replay_events(
    source: _LatencySource,
    hedging: HedgingSettings | None,
    retry: RetrySettings,
    full_bucket: bool,
    passes: int,
    initial_tokens: float | None = None,
    initial_delay: tuple[float, int] | None = None,
    shortcut: bool = True,
) -> _Tally:
    """Play the schedule through the engine's decision core (:class:`~hedgepub._hedging.engine.HedgingCore`,
    which every publisher's driver runs), as a discrete-event simulation on virtual time.

    The driver is the replay's own, not asyncio's: one queue of events (batch starts, attempt answers,
    the core's timers) ordered by time and, at the same time, by when they were queued; each event goes
    to its batch's core and the actions that come back are carried out at once (an attempt sent queues
    its answer at ``now`` plus the latency the model gives it; a timer started queues its firing; a
    cancelled one is forgotten). Batch starts are taken from the schedule in order, so the queue holds
    only the batches in flight: memory follows the concurrency, not the length of the schedule.
    """
    from hedgepub._hedging.bucket import TokenBucket
    from hedgepub._hedging.delay import AdaptiveDelayEstimator
    from hedgepub._hedging.engine import (
        CancelAttempt,
        CancelTimer,
        HedgingCore,
        Resolve,
        SendAttempt,
        StartTimer,
    )

    bucket = TokenBucket.from_settings(hedging) if hedging is not None else None
    if bucket is not None and (full_bucket or initial_tokens is not None):
        wanted = bucket.max_tokens if initial_tokens is None else min(initial_tokens, bucket.max_tokens)
        # the bucket's only way in is a success's refill: as many as that many tokens take
        for _ in range(round(wanted / bucket.refill_ratio)):
            bucket.refill()
    delay_source = None
    if hedging is not None and hedging.adaptive_delay is not None:
        delay_source = AdaptiveDelayEstimator(
            hedging.adaptive_delay, fallback=hedging.hedge_delay, limit=adaptive_delay_limit(retry)
        )
    arrivals, originals = source.arrivals, source.originals
    count = len(arrivals)
    # one pass after the other, a mean gap apart
    period = arrivals[-1] + (arrivals[-1] / (count - 1) if count > 1 else 1.0)
    if delay_source is not None and initial_delay is not None:
        seconds, recorded = initial_delay
        for _ in range(recorded):
            delay_source.record(seconds, 0.0)
    passes = max(1, passes)
    tally = _Tally()
    queue: list[tuple[float, int, int, Any, Any]] = []
    sequence = 0
    # batches in flight with their core (carry_out counts one down when it resolves)
    active = 0
    push, pop = heapq.heappush, heapq.heappop

    def carry_out(batch: _Batch, actions: list[Any], now: float) -> None:
        nonlocal sequence, active
        for action in actions:
            kind = type(action)
            if kind is StartTimer:
                due = now + action.delay
                batch.due[action.timer] = due
                sequence += 1
                push(queue, (due, sequence, _TIMER, batch, action.timer))
            elif kind is SendAttempt:
                if action.attempt_number == 0 and batch.first:
                    batch.first = False
                    latency = originals[batch.index]
                else:
                    latency = source.other(batch.index, now - batch.pass_start)
                batch.running.add(action.attempt_id)
                sequence += 1
                push(queue, (now + latency, sequence, _ANSWER, batch, action.attempt_id))
            elif kind is CancelTimer:
                batch.due.pop(action.timer, None)
            elif kind is CancelAttempt:
                batch.running.discard(action.attempt_id)
            elif kind is Resolve:
                active -= 1
                batch.due.clear()
                batch.running.clear()
                if batch.reported:
                    outcome = action.outcome
                    tally.publishes += 1
                    tally.attempts += outcome.attempts_sent
                    tally.hedges_sent += outcome.hedges_sent
                    if outcome.ok:
                        tally.latencies_ms.append(outcome.latency * 1000.0)
                        tally.hedges_won += outcome.hedge_won
                    else:
                        tally.failed += 1

    total_timeout, first_timeout = retry.total_timeout, retry.rpc_timeout(0)

    def settled_at_once(index: int, start_at: float) -> bool:
        """Whether the batch's original answers before any of its timers is due (most batches do).

        Such a batch's core only asks the delay source for its hedge delay at the start (asked here; a
        second ask at the same moment gets the same answer), and on the answer refills the bucket and
        tells the source the latency (done by the ``_SETTLED`` event); its timers (the deadline's, the
        attempt's timeout, the first hedge) are cancelled unseen. So it is settled without the core and
        its timers. The comparisons are the event queue's on the same floats as ``HedgingCore.start``
        and ``carry_out`` compute them: the deadline's timer is queued before the answer and wins a tie,
        the attempt's timeout and the hedge after it.
        """
        answer_at = start_at + originals[index]
        deadline = start_at + total_timeout
        if answer_at >= start_at + total_timeout:
            return False
        if answer_at > start_at + min(first_timeout, deadline - start_at):
            return False
        if hedging is not None:
            delay = hedging.hedge_delay if delay_source is None else delay_source.delay(start_at)
            at = start_at + delay
            if at < deadline and answer_at > start_at + (at - start_at):
                return False
        return True

    # batches in flight: with their core (active), settled without it (settling)
    next_start, total, settling = 0, passes * count, 0
    while next_start < total or queue:
        if len(queue) > 4 * (active + settling) + 1024:
            # a resolved batch leaves its timers queued (its deadline's, 600 s on): drop them
            queue[:] = [entry for entry in queue if entry[2] == _SETTLED or not entry[3].core.resolved]
            heapq.heapify(queue)
        if next_start < total:
            number, index = divmod(next_start, count)
            start_at = number * period + arrivals[index]
            if not queue or start_at <= queue[0][0]:
                next_start += 1
                reported = number == passes - 1
                if shortcut and settled_at_once(index, start_at):
                    sequence += 1
                    settling += 1
                    push(queue, (start_at + originals[index], sequence, _SETTLED, start_at, reported))
                    continue
                active += 1
                batch = _Batch(
                    HedgingCore(1, retry, hedging, bucket, delay_source), index, number * period, reported
                )
                carry_out(batch, batch.core.start(start_at), start_at)
                continue
        now, _, what, batch, key = pop(queue)
        if what == _SETTLED:
            settling -= 1
            # what HedgingCore.attempt_succeeded does for the original's first try, and its outcome
            if bucket is not None:
                bucket.refill()
            if delay_source is not None:
                delay_source.record(now - batch, now)
            if key:
                tally.publishes += 1
                tally.attempts += 1
                tally.latencies_ms.append((now - batch) * 1000.0)
            continue
        if what == _ANSWER:
            if key in batch.running:
                batch.running.discard(key)
                carry_out(batch, batch.core.attempt_succeeded(key, _IDS, now), now)
        elif batch.due.get(key) == now:
            del batch.due[key]
            carry_out(batch, batch.core.timer_fired(key, now), now)
    return tally


# ---- the advice ---------------------------------------------------------------------------------------


def frontier(predictions: Iterable[Prediction]) -> list[Prediction]:
    """The predictions no other beats on both p99 and extra RPCs, by extra RPCs (the Pareto frontier)."""
    best: list[Prediction] = []
    for prediction in sorted(predictions, key=lambda p: (p.extra_rpcs, p.p99_ms, p.p999_ms)):
        if not best or prediction.p99_ms < best[-1].p99_ms:
            best.append(prediction)
    return best


def recommend(
    predictions: Sequence[Prediction], max_extra_rpcs: float, tolerance: float = 0.02
) -> Prediction:
    """The lowest predicted p99 within ``max_extra_rpcs``; among those within ``tolerance`` of it (a 2%
    difference is replay noise), the fewest extra RPCs, then the lower p99.9."""
    # a hair of slack: 200 hedges over 2,000 publishes is 0.1 in decimal but not in binary
    within = [p for p in predictions if p.extra_rpcs <= max_extra_rpcs + 1e-9 and not math.isnan(p.p99_ms)]
    if not within:
        within = [p for p in predictions if p.name == "unhedged"] or list(predictions)
    best_p99 = min(p.p99_ms for p in within)
    close = [p for p in within if p.p99_ms <= best_p99 * (1 + tolerance)]
    return min(close, key=lambda p: (p.extra_rpcs, p.p999_ms, p.p99_ms))


@dataclass
class Advice:
    """The outcome of :func:`advise`."""

    samples: LatencySamples
    model: str
    predictions: list[Prediction]
    recommended: Prediction
    #: The best fixed-delay setting (Java, Go and Rust have no adaptive delay).
    recommended_fixed: Prediction
    max_extra_rpcs: float
    settings: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The ``advice.json`` document."""
        latencies = sorted(self.samples.latencies_s)
        return {
            "input": {
                "source": self.samples.source,
                "publishes": len(latencies),
                "with_send_times": self.samples.sent_at_s is not None,
                "measured_p50_ms": round(_percentile(latencies, 50) * 1000, 3),
                "measured_p99_ms": round(_percentile(latencies, 99) * 1000, 3),
                "measured_p999_ms": round(_percentile(latencies, 99.9) * 1000, 3),
            },
            "model": self.model,
            "settings": self.settings,
            "max_extra_rpcs": self.max_extra_rpcs,
            "recommended": self.recommended.to_dict(),
            "recommended_fixed": self.recommended_fixed.to_dict(),
            "frontier": [p.name for p in frontier(self.predictions)],
            "predictions": [p.to_dict() for p in self.predictions],
        }


def advise(
    samples: LatencySamples,
    candidates: Sequence[Candidate],
    *,
    max_extra_rpcs: float = 0.1,
    model: Model = "auto",
    rate: float | None = None,
    seed: int = 1,
    retry: RetrySettings | None = None,
    passes: int = 2,
) -> Advice:
    """Predict every candidate and pick the recommendation (see :func:`recommend`)."""
    source_model = _LatencySource(samples, model, rate or samples.rate() or DEFAULT_RATE, seed).model
    predictions = [
        replay(samples, c.hedging, retry=retry, model=model, rate=rate, seed=seed, passes=passes, name=c.name)
        for c in candidates
    ]
    fixed = [p for p in predictions if not p.delay.startswith("adaptive")]
    return Advice(
        samples=samples,
        model=source_model,
        predictions=predictions,
        recommended=recommend(predictions, max_extra_rpcs),
        recommended_fixed=recommend(fixed, max_extra_rpcs),
        max_extra_rpcs=max_extra_rpcs,
        settings={"rate": rate or samples.rate() or DEFAULT_RATE, "seed": seed, "passes": passes},
    )


def write_advice_json(advice: Advice, path: str | Path) -> Path:
    """Write :meth:`Advice.to_dict` as indented JSON."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(advice.to_dict(), indent=2) + "\n", encoding="utf-8")
    return path
