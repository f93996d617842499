"""Publisher statistics: counters and batch-latency percentiles from an HDR histogram."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from hdrh.histogram import HdrHistogram

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from hedgepub._hedging.engine import BatchOutcome
    from hedgepub._publisher.batch import Batch

# Microseconds from 1 us to one hour, three significant digits: 0.1 % error at any scale.
_LOWEST_US = 1
_HIGHEST_US = 3_600_000_000
_SIGNIFICANT_DIGITS = 3


def latency_histogram() -> HdrHistogram:
    """An empty histogram of latencies in microseconds, in the layout above."""
    return HdrHistogram(_LOWEST_US, _HIGHEST_US, _SIGNIFICANT_DIGITS)


def latency_micros(seconds: float) -> int:
    """``seconds`` as whole microseconds, clamped into the range of :func:`latency_histogram`."""
    return min(max(round(seconds * 1_000_000), _LOWEST_US), _HIGHEST_US)


def percentile_ms(histogram: HdrHistogram, percentile: float) -> float:
    """The ``percentile``-th value of a :func:`latency_histogram` in milliseconds (0.0 when empty)."""
    if histogram.get_total_count() == 0:
        return 0.0
    return histogram.get_value_at_percentile(percentile) / 1000.0


def max_ms(histogram: HdrHistogram) -> float:
    """The largest value of a :func:`latency_histogram` in milliseconds (0.0 when empty)."""
    return 0.0 if histogram.get_total_count() == 0 else histogram.get_max_value() / 1000.0


def _json_ready(value: object) -> object:
    """``value`` as JSON's own types: a dataclass or mapping as a dict, a tuple or list as a list."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _json_ready(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(key): _json_ready(item) for key, item in value.items()}
    if isinstance(value, tuple | list):
        return [_json_ready(item) for item in value]
    return value


def _pretty(value: object, indent: int) -> str:
    """``value``'s repr, a field, entry or item a line (indented by ``indent`` spaces), for a dataclass
    that is not ``_ONE_LINE`` and a non-empty mapping or tuple; anything else as ``repr`` gives it."""
    inner, pad = " " * (indent + 4), " " * indent
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        parts = [(f.name, _pretty(getattr(value, f.name), indent + 4)) for f in dataclasses.fields(value)]
        if getattr(value, "_ONE_LINE", False):
            return f"{type(value).__name__}({', '.join(f'{name}={text}' for name, text in parts)})"
        body = "".join(f"{inner}{name}={text},\n" for name, text in parts)
        return f"{type(value).__name__}(\n{body}{pad})"
    if isinstance(value, Mapping) and value:
        body = "".join(f"{inner}{key!r}: {_pretty(item, indent + 4)},\n" for key, item in value.items())
        return f"{{\n{body}{pad}}}"
    if isinstance(value, Mapping):
        return "{}"
    if isinstance(value, tuple) and value:
        body = "".join(f"{inner}{_pretty(item, indent + 4)},\n" for item in value)
        return f"(\n{body}{pad})"
    return repr(value)


class _PlainData:
    """What the stats classes share: ``to_dict()`` and a repr with a field a line."""

    _ONE_LINE: ClassVar[bool] = False

    def to_dict(self: DataclassInstance) -> dict[str, Any]:
        """Every field as JSON's own types (``json.dumps`` takes it): nested stats and mappings as
        dicts, tuples as lists. ``dataclasses.asdict`` works too (it keeps tuples)."""
        return {f.name: _json_ready(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def __repr__(self) -> str:
        return _pretty(self, 0)


@dataclass(frozen=True, repr=False)
class ConnectionStats(_PlainData):
    """What one connection of an endpoint's pool did (a snapshot; see ``EndpointStats.connections``).

    Attributes:
        attempts_sent: Publish RPCs sent on it (on every connection it replaced too).
        attempts_in_flight: attempts on it not answered yet, now.
        state: ``"warm"`` (takes attempts) or ``"silent"`` (nothing came back in time: takes no new
            attempt while another connection is warm, probed, replaced if it stays silent).
        replacements: how many times it was replaced by a new connection after staying silent.
    """

    attempts_sent: int = 0
    attempts_in_flight: int = 0
    state: str = "warm"
    replacements: int = 0

    _ONE_LINE: ClassVar[bool] = True


@dataclass(frozen=True, repr=False)
class EndpointStats(_PlainData):
    """What one endpoint did for a publisher (a snapshot; see ``PublisherStats.endpoints``).

    Attributes:
        attempts_sent: Publish RPCs sent there: originals and retries (primary only) and hedges.
        hedges_sent: the hedges among them.
        attempts_failed: attempts that ended with an error status (unreachable, timed out, refused);
            attempts cancelled because another won are not counted.
        wins: batches whose winning attempt went there.
        p50_ms, p90_ms, p99_ms, max_ms: latency of the attempts that answered with message IDs, from
            their own send to their answer, in milliseconds (0.0 before any answered).
        attempts_in_flight: attempts sent there and not answered yet, now.
        reachable: False while its latest attempts failed without reaching it (connection refused, no
            route, a silent host), True otherwise (also before the first attempt).
        last_error: the latest failed attempt's error there, as text (None before any failed).
        connections: each connection of its pool (``channel_pool_size`` of them once it is opened).
    """

    attempts_sent: int = 0
    hedges_sent: int = 0
    attempts_failed: int = 0
    wins: int = 0
    p50_ms: float = 0.0
    p90_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0
    attempts_in_flight: int = 0
    reachable: bool = True
    last_error: str | None = None
    connections: tuple[ConnectionStats, ...] = ()


@dataclass(frozen=True, repr=False)
class PublisherStats(_PlainData):
    """A snapshot of what a publisher has done since it was created.

    Plain data: ``to_dict()`` gives it as JSON's own types (for ``json.dumps`` or a log line),
    ``dataclasses.asdict`` works, and its repr puts a field on each line. The mappings are copies made
    for this snapshot.

    Attributes:
        messages_published: messages whose future resolved with a message ID.
        messages_failed: messages whose future resolved with an error (after validation passed).
        batches_sent: batches that went through the hedging engine (one Publish request each, plus
            its retries and hedges), including those ``shutdown(timeout)`` cut off, which count as
            failed, with the attempts and hedges they had sent.
        attempts_sent: Publish RPCs sent: originals, retries and hedges (counted when their batch ends;
            ``attempts_in_flight`` shows those running now).
        attempts_in_flight: Publish RPCs sent and not answered yet, now, over every endpoint.
        hedges_sent: hedged attempts sent.
        hedges_won: batches whose winning attempt was a hedge.
        hedges_skipped: hedge points where no token was available.
        unhedged_keyed_batches: batches left unhedged because they carry an ordering key (a hedging
            publisher never hedges those, docs/hedging.md rule 23; 0 when hedging is off).
        tokens_available: tokens now in the hedging buckets of every topic together (0.0 when hedging
            is off); each topic has a bucket of its own, see ``tokens_by_topic``.
        tokens_by_topic: tokens now in each topic's hedging bucket, for every topic that has sent an
            unkeyed batch (empty when hedging is off).
        hedge_delay_ms: the hedge delay now, in milliseconds: the fixed ``hedge_delay``, or with
            ``adaptive_delay`` the one the latest batch was given (0.0 when hedging is off).
        p50_ms, p90_ms, p99_ms, p999_ms, max_ms: batch publish latency, from the first attempt sent
            to the batch's resolution, over every batch sent (successful or not), in milliseconds.
        endpoints: per endpoint (``host:port``), the primary first and then any ``hedge_endpoints``:
            attempts, hedges, failed attempts, wins and attempt latency (:class:`~hedgepub.EndpointStats`).
    """

    messages_published: int = 0
    messages_failed: int = 0
    batches_sent: int = 0
    attempts_sent: int = 0
    hedges_sent: int = 0
    hedges_won: int = 0
    hedges_skipped: int = 0
    unhedged_keyed_batches: int = 0
    tokens_available: float = 0.0
    tokens_by_topic: Mapping[str, float] = field(default_factory=dict)
    hedge_delay_ms: float = 0.0
    p50_ms: float = 0.0
    p90_ms: float = 0.0
    p99_ms: float = 0.0
    p999_ms: float = 0.0
    max_ms: float = 0.0
    endpoints: Mapping[str, EndpointStats] = field(default_factory=dict)
    attempts_in_flight: int = 0


class StatsRecorder:
    """Collects the counters behind :class:`PublisherStats`; safe to read from any thread.

    ``hedging`` says whether the publisher hedges (so that its keyed batches count as left unhedged).
    """

    def __init__(self, *, hedging: bool = False) -> None:
        self._hedging = hedging
        self._lock = threading.Lock()
        self._histogram = latency_histogram()
        self.messages_published = 0
        self.messages_failed = 0
        self.batches_sent = 0
        self.attempts_sent = 0
        self.hedges_sent = 0
        self.hedges_won = 0
        self.hedges_skipped = 0
        self.unhedged_keyed_batches = 0

    def batch_finished(self, batch: Batch, outcome: BatchOutcome | None, error: BaseException | None) -> None:
        """Count one finished batch (a :class:`~hedgepub._publisher.observer.BatchObserver`): as its
        ``outcome`` tells, or, with none (an internal error), as failed messages only."""
        messages = batch.message_count
        if outcome is None:
            self.record_failed(messages)
            return
        micros = latency_micros(outcome.latency)
        with self._lock:
            if outcome.ok:
                self.messages_published += messages
            else:
                self.messages_failed += messages
            self.batches_sent += 1
            self.attempts_sent += outcome.attempts_sent
            self.hedges_sent += outcome.hedges_sent
            self.hedges_won += int(outcome.hedge_won)
            self.hedges_skipped += outcome.hedges_skipped
            if self._hedging and batch.ordering_key:
                self.unhedged_keyed_batches += 1
            self._histogram.record_value(micros)

    def record_failed(self, messages: int) -> None:
        """Count messages that failed without a batch reaching the engine (paused key, shutdown)."""
        with self._lock:
            self.messages_failed += messages

    def snapshot(
        self,
        tokens_available: float,
        hedge_delay: float = 0.0,
        *,
        endpoints: Mapping[str, EndpointStats] | None = None,
        tokens_by_topic: Mapping[str, float] | None = None,
    ) -> PublisherStats:
        """The counters and percentiles now, with the buckets' tokens (all together and by topic), the
        hedge delay (seconds) and the per-endpoint stats."""
        with self._lock:
            histogram = self._histogram
            return PublisherStats(
                messages_published=self.messages_published,
                messages_failed=self.messages_failed,
                batches_sent=self.batches_sent,
                attempts_sent=self.attempts_sent,
                hedges_sent=self.hedges_sent,
                hedges_won=self.hedges_won,
                hedges_skipped=self.hedges_skipped,
                unhedged_keyed_batches=self.unhedged_keyed_batches,
                tokens_available=tokens_available,
                tokens_by_topic=tokens_by_topic if tokens_by_topic is not None else {},
                hedge_delay_ms=hedge_delay * 1000.0,
                p50_ms=percentile_ms(histogram, 50),
                p90_ms=percentile_ms(histogram, 90),
                p99_ms=percentile_ms(histogram, 99),
                p999_ms=percentile_ms(histogram, 99.9),
                max_ms=max_ms(histogram),
                endpoints=endpoints if endpoints is not None else {},
                attempts_in_flight=sum(e.attempts_in_flight for e in (endpoints or {}).values()),
            )
