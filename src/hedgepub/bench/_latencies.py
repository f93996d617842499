"""The measured latencies that ``hedgepub advise`` replays (:class:`LatencySamples`), read by
:func:`load_latencies` from a bench ``results.json``, a CSV of per-publish latencies, a Cloud Monitoring
export or an OpenTelemetry metrics export (see :mod:`hedgepub.bench._advise`).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

#: The input formats ``load_latencies`` reads.
InputKind = Literal["auto", "bench", "csv", "monitoring", "otel"]
INPUT_KINDS: tuple[str, ...] = ("auto", "bench", "csv", "monitoring", "otel")
#: The name of hedgepub's batch latency histogram (see hedgepub._publisher.telemetry).
OTEL_LATENCY_METRIC = "hedgepub.publish.latency"
#: The Cloud Monitoring metric of the service's own publish latency.
MONITORING_METRIC = "pubsub.googleapis.com/topic/send_request_latencies"
#: A distribution is expanded to at most this many samples (bucket counts scaled down alike).
MAX_DISTRIBUTION_SAMPLES = 20_000


@dataclass(frozen=True)
class LatencySamples:
    """Measured publish latencies (seconds), with their send times (seconds) when known."""

    latencies_s: tuple[float, ...]
    sent_at_s: tuple[float, ...] | None = None
    #: Where they came from, for the report.
    source: str = ""

    def __post_init__(self) -> None:
        if not self.latencies_s:
            raise ValueError(f"no latencies found in {self.source or 'the input'}")
        if any(not math.isfinite(value) or value < 0 for value in self.latencies_s):
            raise ValueError(f"latencies must be finite and >= 0 ({self.source})")
        if self.sent_at_s is not None and len(self.sent_at_s) != len(self.latencies_s):
            raise ValueError("sent_at_s and latencies_s must have the same length")

    def rate(self) -> float | None:
        """Publishes per second over the span of the send times, when they are known."""
        if self.sent_at_s is None or len(self.sent_at_s) < 2:
            return None
        span = max(self.sent_at_s) - min(self.sent_at_s)
        return (len(self.sent_at_s) - 1) / span if span > 0 else None


# ---- inputs ---------------------------------------------------------------------------------------------


def load_latencies(path: str | Path, kind: InputKind = "auto", publisher: str = "unhedged") -> LatencySamples:
    """Read measured latencies from ``path`` (see the module docstring for the formats).

    ``kind`` ``auto`` tells them apart by content: a ``.csv`` file is a CSV; JSON with ``samples`` is a
    bench result, with ``timeSeries`` (or a list of time series) a Cloud Monitoring export, with
    ``resourceMetrics`` / ``resource_metrics`` an OpenTelemetry export. ``publisher`` picks which of a
    bench run's publishers to read (the unhedged one: what the service does without hedging).
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if kind == "auto":
        kind = _detect(path, text)
    if kind == "csv":
        return _from_csv(text, str(path))
    document = json.loads(text)
    if kind == "bench":
        return _from_bench(document, publisher, str(path))
    if kind == "monitoring":
        return _from_monitoring(document, str(path))
    if kind == "otel":
        return _from_otel(document, str(path))
    raise ValueError(f"kind must be one of {', '.join(INPUT_KINDS)}; got {kind!r}")


def _detect(path: Path, text: str) -> InputKind:
    if path.suffix.lower() == ".csv":
        return "csv"
    try:
        document = json.loads(text)
    except json.JSONDecodeError:
        return "csv"
    if isinstance(document, list) or (isinstance(document, dict) and "timeSeries" in document):
        return "monitoring"
    if isinstance(document, dict) and ("resourceMetrics" in document or "resource_metrics" in document):
        return "otel"
    if isinstance(document, dict) and "results" in document:
        return "bench"
    raise ValueError(
        f"{path}: cannot tell the format (a bench results.json, a CSV, a Cloud Monitoring timeSeries "
        "export or an OpenTelemetry metrics export); give --format"
    )


def _from_bench(document: Mapping[str, Any], publisher: str, source: str) -> LatencySamples:
    samples = document.get("samples")
    if not samples:
        raise ValueError(f"{source} holds no per-publish samples (written by hedgepub bench since samples)")
    if publisher not in samples:
        raise ValueError(f"{source} has no publisher {publisher!r}; it has {', '.join(samples)}")
    entry = samples[publisher]
    latencies = tuple(value / 1000.0 for value in entry["latency_ms"])
    sent = entry.get("sent_at_s")
    return LatencySamples(latencies, tuple(sent) if sent else None, f"{source} ({publisher})")


#: CSV columns read as latency, by unit; the first present wins.
_LATENCY_COLUMNS = {"latency_ms": 1e-3, "latency_s": 1.0, "latency_us": 1e-6, "latency": 1e-3}
_SENT_COLUMNS = ("sent_at_s", "timestamp_s", "sent_at")


def _from_csv(text: str, source: str) -> LatencySamples:
    """A header row naming ``latency_ms`` (or ``latency_s``, ``latency_us``) and optionally
    ``sent_at_s``; or no header and one latency in milliseconds per line."""
    rows = [row for row in csv.reader(text.splitlines()) if row and any(cell.strip() for cell in row)]
    if not rows:
        raise ValueError(f"{source}: empty CSV")
    header = [cell.strip().lower() for cell in rows[0]]
    named = [(header.index(name), unit) for name, unit in _LATENCY_COLUMNS.items() if name in header]
    column, scale = named[0] if named else (None, 1e-3)
    sent_column = next((header.index(name) for name in _SENT_COLUMNS if name in header), None)
    body = rows[1:]
    if column is None:
        try:
            float(rows[0][0])
        except ValueError:
            raise ValueError(
                f"{source}: no latency column: name one latency_ms, latency_s or latency_us"
            ) from None
        column, body = 0, rows
    latencies, sent = [], []
    for number, row in enumerate(body, start=2 if body is not rows else 1):
        try:
            latencies.append(float(row[column]) * scale)
            if sent_column is not None:
                sent.append(float(row[sent_column]))
        except (ValueError, IndexError):
            raise ValueError(f"{source}, line {number}: not a number: {row!r}") from None
    return LatencySamples(tuple(latencies), tuple(sent) if sent_column is not None else None, source)


def _bucket_bounds(options: Mapping[str, Any], buckets: int) -> list[float]:
    """Upper bounds of the finite buckets of Cloud Monitoring ``bucketOptions`` (at least ``buckets``)."""
    if "explicitBuckets" in options:
        return [float(bound) for bound in options["explicitBuckets"].get("bounds", [])]
    if "exponentialBuckets" in options:
        exp = options["exponentialBuckets"]
        count, growth, scale = int(exp["numFiniteBuckets"]), float(exp["growthFactor"]), float(exp["scale"])
        return [scale * growth**index for index in range(count + 1)]
    if "linearBuckets" in options:
        lin = options["linearBuckets"]
        count, width, offset = int(lin["numFiniteBuckets"]), float(lin["width"]), float(lin["offset"])
        return [offset + width * index for index in range(count + 1)]
    raise ValueError(f"unknown bucketOptions: {sorted(options)}")


def expand_histogram(bounds: Sequence[float], counts: Sequence[int], scale: float) -> list[float]:
    """Samples (seconds) spread through each bucket of a histogram: ``counts[0]`` below ``bounds[0]``,
    ``counts[i]`` in ``[bounds[i-1], bounds[i])``, the last above ``bounds[-1]``; values times ``scale``.

    Values are spaced evenly inside a bucket (geometrically where the bucket starts above zero), and
    the overflow bucket is placed at its lower bound (the export says no more). Counts are scaled down
    alike above :data:`MAX_DISTRIBUTION_SAMPLES`, keeping at least one sample in every non-empty bucket.
    """
    total = sum(counts)
    factor = min(1.0, MAX_DISTRIBUTION_SAMPLES / total) if total else 1.0
    values: list[float] = []
    for index, count in enumerate(counts):
        if count <= 0:
            continue
        count = max(1, round(count * factor))
        low = bounds[index - 1] if index > 0 else 0.0
        high = bounds[index] if index < len(bounds) else None
        for step in range(count):
            position = (step + 0.5) / count
            if high is None:
                value = low
            elif low > 0:
                value = low * (high / low) ** position
            else:
                value = low + (high - low) * position
            values.append(value * scale)
    return values


_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "ns": 1e-9}


def _from_monitoring(document: Any, source: str) -> LatencySamples:
    """A Cloud Monitoring ``timeSeries.list`` response (or its ``timeSeries`` list): every point's
    ``distributionValue`` of every series, merged. The unit is the series' ``unit`` (``us`` for
    ``topic/send_request_latencies``), microseconds when absent."""
    series_list = document if isinstance(document, list) else document.get("timeSeries", [])
    values: list[float] = []
    for series in series_list:
        scale = _UNITS.get(str(series.get("unit", "us")), 1e-6)
        for point in series.get("points", []):
            distribution = point.get("value", {}).get("distributionValue")
            if not distribution:
                continue
            counts = [int(count) for count in distribution.get("bucketCounts", [])]
            if not counts:
                continue
            bounds = _bucket_bounds(distribution.get("bucketOptions", {}), len(counts))
            values += expand_histogram(bounds, counts, scale)
    return LatencySamples(tuple(values), None, f"{source} (Cloud Monitoring distribution)")


def _camel_or_snake(entry: Mapping[str, Any], camel: str, snake: str, default: Any = None) -> Any:
    return entry.get(camel, entry.get(snake, default))


def _attributes(point: Mapping[str, Any]) -> dict[str, Any]:
    raw = point.get("attributes", {})
    if isinstance(raw, dict):  # the Python SDK's to_json
        return raw
    out = {}
    for item in raw:  # OTLP JSON: [{"key": ..., "value": {"stringValue": ...}}]
        value = item.get("value", {})
        out[item.get("key")] = next(iter(value.values()), None) if value else None
    return out


def _from_otel(document: Mapping[str, Any], source: str) -> LatencySamples:
    """``hedgepub.publish.latency`` data points with ``hedgepub.outcome`` ``ok`` (all when unlabelled)."""
    values: list[float] = []
    for resource in _camel_or_snake(document, "resourceMetrics", "resource_metrics", []):
        for scope in _camel_or_snake(resource, "scopeMetrics", "scope_metrics", []):
            for metric in scope.get("metrics", []):
                if metric.get("name") != OTEL_LATENCY_METRIC:
                    continue
                scale = _UNITS.get(str(metric.get("unit", "s")), 1.0)
                data = metric.get("histogram") or metric.get("data") or {}
                for point in _camel_or_snake(data, "dataPoints", "data_points", []):
                    if _attributes(point).get("hedgepub.outcome", "ok") != "ok":
                        continue
                    raw_bounds = _camel_or_snake(point, "explicitBounds", "explicit_bounds", [])
                    raw_counts = _camel_or_snake(point, "bucketCounts", "bucket_counts", [])
                    bounds = [float(bound) for bound in raw_bounds]
                    counts = [int(count) for count in raw_counts]
                    values += expand_histogram(bounds, counts, scale)
    if not values:
        raise ValueError(f"{source}: no {OTEL_LATENCY_METRIC} histogram points with outcome ok")
    return LatencySamples(tuple(values), None, f"{source} ({OTEL_LATENCY_METRIC})")
