"""The bench's results: latency percentiles per publisher, the JSON document, and the table.

The publishers are the unhedged one (always first: the others are compared with it) and any number of
hedged ones, each a column of the table and an entry of ``results.json``.

Latencies are recorded in an HdrHistogram in microseconds (3 significant digits, so a percentile is
within 0.1% of the exact value) and reported in milliseconds.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hdrh.histogram import HdrHistogram
from rich.console import Console
from rich.table import Table

#: The percentiles the bench reports, as (key suffix, percentile, label).
PERCENTILES: tuple[tuple[str, float, str], ...] = (
    ("p50", 50.0, "p50"),
    ("p90", 90.0, "p90"),
    ("p99", 99.0, "p99"),
    ("p999", 99.9, "p99.9"),
)

#: The keys of every publisher's entry in ``results.json``, in order.
RESULT_KEYS: tuple[str, ...] = (
    "published",
    "failed",
    "p50_ms",
    "p90_ms",
    "p99_ms",
    "p999_ms",
    "max_ms",
    "attempts_per_publish",
    "hedges_sent",
    "hedges_won",
    "duplicates",
    "hedge_delay_ms",
    "duplicates_after_dedup",
    "hedges_by_endpoint",
)

#: The name of the publisher every other is compared with.
UNHEDGED = "unhedged"

_LOWEST_US = 1
_HIGHEST_US = 3_600 * 1_000_000  # one hour: far above any publish the bench waits for


@dataclass
class LatencyRecorder:
    """Caller-side latencies of one publisher's publishes, in an HdrHistogram and as a raw list."""

    histogram: HdrHistogram = field(default_factory=lambda: HdrHistogram(_LOWEST_US, _HIGHEST_US, 3))
    latencies_ms: list[float] = field(default_factory=list)
    #: When each publish started, in seconds from the start of the measured period (same order as
    #: ``latencies_ms``); ``hedgepub advise`` replays the latencies at these moments.
    sent_at_s: list[float] = field(default_factory=list)

    def record(self, seconds: float, sent_at: float | None = None) -> None:
        """Record one publish that took ``seconds`` and started ``sent_at`` s into the measured period."""
        microseconds = min(max(round(seconds * 1_000_000), _LOWEST_US), _HIGHEST_US)
        self.histogram.record_value(microseconds)
        self.latencies_ms.append(seconds * 1000.0)
        if sent_at is not None:
            self.sent_at_s.append(sent_at)

    def samples(self) -> dict[str, list[float]]:
        """The per-publish record for ``results.json``: send times (s) and latencies (ms), rounded."""
        return {
            "sent_at_s": [round(value, 6) for value in self.sent_at_s],
            "latency_ms": [round(value, 3) for value in self.latencies_ms],
        }

    @property
    def count(self) -> int:
        """Number of latencies recorded."""
        return self.histogram.get_total_count()

    def percentile_ms(self, percentile: float) -> float:
        """The latency at ``percentile`` (0 to 100) in milliseconds; NaN when nothing was recorded."""
        if self.count == 0:
            return math.nan
        return self.histogram.get_value_at_percentile(percentile) / 1000.0

    def max_ms(self) -> float:
        """The largest latency in milliseconds; NaN when nothing was recorded."""
        if self.count == 0:
            return math.nan
        return self.histogram.get_max_value() / 1000.0


@dataclass(frozen=True)
class PublisherResult:
    """What one publisher did during the measured period of the bench."""

    published: int
    failed: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    p999_ms: float
    max_ms: float
    attempts_per_publish: float
    hedges_sent: int
    hedges_won: int
    #: Extra stored copies; ``None`` where not counted (a bench against a remote service).
    duplicates: int | None
    #: The hedge delay at the end of the measured period (the adaptive one moves); ``None`` unhedged.
    hedge_delay_ms: float | None = None
    #: Copies left once the stored messages go through :class:`~hedgepub.Deduplicator` (0 when the
    #: publisher stamped idempotency keys; as many as ``duplicates`` when it did not).
    duplicates_after_dedup: int | None = 0
    #: Hedges sent to each endpoint during the measured period: ``primary``, and ``second`` (the
    #: correlated-stalls scenario's other server).
    hedges_by_endpoint: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def from_measurements(
        cls,
        recorder: LatencyRecorder,
        *,
        failed: int,
        attempts_sent: int,
        hedges_sent: int,
        hedges_won: int,
        duplicates: int | None,
        hedge_delay_ms: float | None = None,
        duplicates_after_dedup: int | None = None,
        hedges_by_endpoint: Mapping[str, int] | None = None,
    ) -> PublisherResult:
        """Summarise the recorded latencies and the publisher's counters."""
        publishes = recorder.count + failed
        return cls(
            published=recorder.count,
            failed=failed,
            p50_ms=recorder.percentile_ms(50.0),
            p90_ms=recorder.percentile_ms(90.0),
            p99_ms=recorder.percentile_ms(99.0),
            p999_ms=recorder.percentile_ms(99.9),
            max_ms=recorder.max_ms(),
            attempts_per_publish=attempts_sent / publishes if publishes else math.nan,
            hedges_sent=hedges_sent,
            hedges_won=hedges_won,
            duplicates=duplicates,
            hedge_delay_ms=hedge_delay_ms,
            duplicates_after_dedup=duplicates if duplicates_after_dedup is None else duplicates_after_dedup,
            hedges_by_endpoint=dict(hedges_by_endpoint) if hedges_by_endpoint is not None else {},
        )

    def to_dict(self) -> dict[str, Any]:
        """The entry for ``results.json``: exactly :data:`RESULT_KEYS`, floats rounded to 0.001."""
        entry: dict[str, Any] = {}
        for key in RESULT_KEYS:
            value = getattr(self, key)
            entry[key] = _json_number(value)
        return entry


def _json_number(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _json_number(item) for key, item in value.items()}
    if value is None or isinstance(value, int):
        return value
    if math.isnan(value):
        return None  # JSON has no NaN; null says "nothing measured"
    return round(value, 3)


def results_document(
    config: Mapping[str, Any],
    results: Mapping[str, PublisherResult],
    samples: Mapping[str, Mapping[str, list[float]]] | None = None,
) -> dict[str, Any]:
    """The ``results.json`` document: ``{"config": {...}, "results": {"unhedged": {...}, NAME: ...}}``.

    ``results`` must hold the unhedged publisher and at least one other; the unhedged one comes first.
    ``samples`` (per publisher: ``sent_at_s`` and ``latency_ms`` of every successful publish) are kept
    under ``"samples"``, where ``hedgepub advise`` reads them.
    """
    if UNHEDGED not in results or len(results) < 2:
        raise ValueError(f"results need {UNHEDGED!r} and at least one hedged publisher; got {list(results)}")
    order = [UNHEDGED, *(name for name in results if name != UNHEDGED)]
    document: dict[str, Any] = {
        "config": dict(config),
        "results": {name: results[name].to_dict() for name in order},
    }
    if samples is not None:
        document["samples"] = {name: dict(samples[name]) for name in order if name in samples}
    return document


def write_results_json(document: Mapping[str, Any], path: str | Path) -> Path:
    """Write ``document`` as indented JSON to ``path`` (parent directories are created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return path


def ratio(hedged: float | int | None, unhedged: float | int | None) -> float | None:
    """``hedged / unhedged``, or ``None`` when either is missing or the unhedged value is zero."""
    if hedged is None or unhedged is None or unhedged == 0:
        return None
    if isinstance(hedged, float) and math.isnan(hedged):
        return None
    if isinstance(unhedged, float) and math.isnan(unhedged):
        return None
    return hedged / unhedged


def _rows(document: Mapping[str, Any]) -> Iterable[list[str]]:
    """The report's rows, formatted: a label, then one cell per publisher (unhedged first).

    Latency cells of hedged publishers carry their ratio to the unhedged one, e.g. ``212 (0.05x)``.
    """
    results = document["results"]
    names = list(results)
    unhedged = results[UNHEDGED]
    for key, _, label in (*PERCENTILES, ("max", 100.0, "max")):
        name = f"{key}_ms"
        row = [f"{label} latency (ms)"]
        for publisher in names:
            value = results[publisher][name]
            share = None if publisher == UNHEDGED else ratio(value, unhedged[name])
            row.append(format_ms(value) + ("" if share is None else f" ({share:.2f}x)"))
        yield row
    yield ["attempts per publish", *(_format_float(results[n]["attempts_per_publish"]) for n in names)]
    yield ["hedge delay (ms)", *(format_ms(results[n].get("hedge_delay_ms")) for n in names)]
    for key, label in (
        ("hedges_sent", "hedges sent"),
        ("hedges_won", "hedges won"),
        ("published", "published"),
        ("failed", "failed"),
        ("duplicates", "duplicates on server"),
        ("duplicates_after_dedup", "duplicates after dedup"),
    ):
        yield [label, *("-" if results[n].get(key) is None else str(results[n][key]) for n in names)]
    endpoints = list(dict.fromkeys(e for n in names for e in results[n].get("hedges_by_endpoint") or {}))
    if endpoints != ["primary"] and endpoints:
        # Only worth a row each when hedges went somewhere other than the primary.
        for endpoint in endpoints:
            yield [
                f"hedges to {endpoint}",
                *(str((results[n].get("hedges_by_endpoint") or {}).get(endpoint, 0)) for n in names),
            ]


def format_ms(value: float | None) -> str:
    """A latency in ms as the table, ``results.json`` readers and the plot show it: "4,006", "10.5", "-"."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.1f}" if value < 100 else f"{value:,.0f}"


def _format_float(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


#: The table's title; latency cells of hedged publishers show their ratio to the unhedged one.
TITLE = "Publish latency by publisher (in brackets: hedged / unhedged)"


def build_table(document: Mapping[str, Any], title: str | None = TITLE) -> Table:
    """A rich table of the results: one row per measure, one column per publisher."""
    table = Table(title=title, title_justify="left")
    table.add_column("measure")
    for name in document["results"]:
        table.add_column(name, justify="right")
    for row in _rows(document):
        table.add_row(*row)
    return table


def render_markdown(document: Mapping[str, Any]) -> str:
    """The same table as :func:`build_table`, in Markdown (for the README)."""
    names = list(document["results"])
    lines = [f"| measure | {' | '.join(names)} |", "|---|" + "---:|" * len(names)]
    lines += [f"| {' | '.join(row)} |" for row in _rows(document)]
    return "\n".join(lines)


def print_report(document: Mapping[str, Any], console: Console | None = None) -> None:
    """Print the results table to ``console`` (standard output by default)."""
    (console or Console()).print(build_table(document))
