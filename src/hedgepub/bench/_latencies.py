"""The measured latencies that ``hedgepub advise`` replays (:class:`LatencySamples`), read by
:func:`load_latencies` from a bench ``results.json``, a CSV of per-publish latencies, a Cloud Monitoring
export or an OpenTelemetry metrics export (see :mod:`hedgepub.bench._advise`).

Every input is read in bounded memory and time, and anything else is refused with a ``ValueError`` that
says why (``hedgepub advise`` exits with 1): a CSV is read a line at a time, up to ``max_publishes``
rows of at most :data:`MAX_LINE_BYTES`; a JSON input may be at most :data:`MAX_JSON_BYTES`; histograms
are merged bucket by bucket (at most :data:`MAX_BUCKETS` distinct ones) and expanded once, to at most
:data:`MAX_DISTRIBUTION_SAMPLES`; latencies must be finite, at least 0 and at most
:data:`MAX_LATENCY_S`, send times finite and spanning at most :data:`MAX_SPAN_S`.
"""

from __future__ import annotations

import array
import contextlib
import csv
import itertools
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

#: The input formats ``load_latencies`` reads.
InputKind = Literal["auto", "bench", "csv", "monitoring", "otel"]
INPUT_KINDS: tuple[str, ...] = ("auto", "bench", "csv", "monitoring", "otel")
#: The name of hedgepub's batch latency histogram (see hedgepub._publisher.telemetry).
OTEL_LATENCY_METRIC = "hedgepub.publish.latency"
#: The Cloud Monitoring metric of the service's own publish latency.
MONITORING_METRIC = "pubsub.googleapis.com/topic/send_request_latencies"
#: A distribution is expanded to at most this many samples (bucket counts scaled down alike).
MAX_DISTRIBUTION_SAMPLES = 20_000
#: Per-publish latencies read by default (a CSV's rows, a bench publisher's samples): the replay's time
#: grows with them (about 2 s of CPU per 1,000 publishes for the default grid).
MAX_PUBLISHES = 200_000
#: The largest JSON input (bench, Cloud Monitoring, OpenTelemetry): it is parsed whole.
MAX_JSON_BYTES = 32 * 1024 * 1024
#: The longest line of a CSV.
MAX_LINE_BYTES = 64 * 1024
#: Distinct histogram buckets over every point of an export, and finite buckets of one point.
MAX_BUCKETS = 100_000
#: The longest latency taken (a day): a publisher gives up after its total timeout (600 s by default).
MAX_LATENCY_S = 86_400.0
#: The longest span of send times (30 days), and the largest send time (seconds, an epoch's included).
MAX_SPAN_S = 30 * 86_400.0
MAX_SEND_TIME_S = 1e12
#: Bucket counts are int64 in Cloud Monitoring and OpenTelemetry.
_MAX_COUNT = 2**63 - 1


@dataclass(frozen=True)
class LatencySamples:
    """Measured publish latencies (seconds), with their send times (seconds) when known.

    Raises ``ValueError`` for no latencies, a latency that is not finite or outside ``[0,``
    :data:`MAX_LATENCY_S` ``]``, a send time that is not finite or beyond :data:`MAX_SEND_TIME_S`, send
    times spanning more than :data:`MAX_SPAN_S`, or as many send times as latencies.
    """

    latencies_s: tuple[float, ...]
    sent_at_s: tuple[float, ...] | None = None
    #: Where they came from, for the report.
    source: str = ""

    def __post_init__(self) -> None:
        where = self.source or "the input"
        if not self.latencies_s:
            raise ValueError(f"no latencies found in {where}")
        if any(not 0 <= value <= MAX_LATENCY_S for value in self.latencies_s):  # NaN fails too
            raise ValueError(
                f"latencies must be finite, at least 0 and at most {MAX_LATENCY_S:,.0f} s ({where})"
            )
        if self.sent_at_s is not None:
            if len(self.sent_at_s) != len(self.latencies_s):
                raise ValueError("sent_at_s and latencies_s must have the same length")
            if any(not -MAX_SEND_TIME_S <= value <= MAX_SEND_TIME_S for value in self.sent_at_s):
                raise ValueError(f"send times must be finite seconds, at most {MAX_SEND_TIME_S:g} ({where})")
            if max(self.sent_at_s) - min(self.sent_at_s) > MAX_SPAN_S:
                raise ValueError(f"send times may span at most {MAX_SPAN_S / 86_400:g} days ({where})")

    def rate(self) -> float | None:
        """Publishes per second over the span of the send times, when they are known."""
        if self.sent_at_s is None or len(self.sent_at_s) < 2:
            return None
        span = max(self.sent_at_s) - min(self.sent_at_s)
        return (len(self.sent_at_s) - 1) / span if span > 0 else None


# ---- inputs ---------------------------------------------------------------------------------------------


def load_latencies(
    path: str | Path,
    kind: InputKind = "auto",
    publisher: str = "unhedged",
    max_publishes: int = MAX_PUBLISHES,
) -> LatencySamples:
    """Read measured latencies from ``path`` (see the module docstring for the formats and limits).

    ``kind`` ``auto`` tells them apart by content: a ``.csv`` file is a CSV, so is a file that does not
    start with ``{`` or ``[``; JSON with ``samples`` is a bench result, with ``timeSeries`` (or a list of
    time series) a Cloud Monitoring export, with ``resourceMetrics`` / ``resource_metrics`` an
    OpenTelemetry export. ``publisher`` picks which of a bench run's publishers to read (the unhedged
    one: what the service does without hedging). At most ``max_publishes`` per-publish latencies are
    read; more is refused.

    Raises:
        OSError: the file cannot be read.
        ValueError: anything in it that is not such an input, or beyond the limits (what and where).
    """
    path = Path(path)
    if kind == "auto":
        kind = _detect(path)
    if kind == "csv":
        with path.open(encoding="utf-8", newline="") as stream:
            return _from_csv(stream, str(path), max_publishes)
    if kind not in INPUT_KINDS:
        raise ValueError(f"kind must be one of {', '.join(INPUT_KINDS)}; got {kind!r}")
    document = _read_json(path)
    if kind == "auto":
        kind = _json_kind(path, document)
    if kind == "bench":
        return _from_bench(document, publisher, str(path), max_publishes)
    if kind == "monitoring":
        return _from_monitoring(document, str(path))
    return _from_otel(document, str(path))


def _detect(path: Path) -> InputKind:
    """``csv`` for a ``.csv`` file or one that does not start like JSON; ``auto`` (look inside) else."""
    if path.suffix.lower() == ".csv":
        return "csv"
    with path.open("rb") as stream:
        start = stream.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return "auto" if start[:1] in (b"{", b"[") else "csv"


def _read_json(path: Path) -> Any:
    with path.open("rb") as stream:
        data = stream.read(MAX_JSON_BYTES + 1)
    if len(data) > MAX_JSON_BYTES:
        raise ValueError(
            f"{path}: a JSON input may be at most {MAX_JSON_BYTES // (1024 * 1024)} MiB (it is parsed "
            "whole); split it (a shorter interval of the export) or give per-publish latencies as a CSV"
        )
    try:
        text = data.decode("utf-8")
        del data  # the text and what is parsed from it are what is held from here on
        return json.loads(text, object_hook=_compact_counts)
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 ({error.reason} at byte {error.start})") from None
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{path}: not JSON ({error.msg} at line {error.lineno}, column {error.colno})"
        ) from None


#: The keys of histogram bucket counts (Cloud Monitoring, OpenTelemetry's two spellings).
_COUNT_KEYS = ("bucketCounts", "bucket_counts")


def _compact_counts(entry: dict[str, Any]) -> dict[str, Any]:
    """A JSON object as parsed, with its bucket counts (when every one is valid) as an ``array`` of int64
    rather than a list of strings: an export's counts are most of its bytes, and as a list of strings they
    took about 18 times their size (a 30 MiB export peaked at 568 MiB). Invalid counts are left as they
    are, for the reader to refuse with its own message."""
    for key in _COUNT_KEYS:
        raw = entry.get(key)
        if type(raw) is list and raw:
            with contextlib.suppress(ValueError):  # refused later by _counts, which says where
                entry[key] = array.array("q", [_count(count, key) for count in raw])
    return entry


def _raw_counts(value: Any, what: str) -> Sequence[Any]:
    """A point's bucket counts as parsed: compacted by :func:`_compact_counts`, or a JSON list."""
    return value if isinstance(value, array.array) else _sequence(value, what)


def _counts(raw: Sequence[Any], what: str) -> Sequence[int]:
    """:func:`_raw_counts` as whole numbers (compacted ones were checked as they were parsed)."""
    return raw if isinstance(raw, array.array) else [_count(count, what) for count in raw]


def _json_kind(path: Path, document: Any) -> InputKind:
    if isinstance(document, list) or (isinstance(document, dict) and "timeSeries" in document):
        return "monitoring"
    if isinstance(document, dict) and ("resourceMetrics" in document or "resource_metrics" in document):
        return "otel"
    if isinstance(document, dict) and ("results" in document or "samples" in document):
        return "bench"
    raise ValueError(
        f"{path}: cannot tell the format (a bench results.json, a CSV, a Cloud Monitoring timeSeries "
        "export or an OpenTelemetry metrics export); give --format"
    )


def _mapping(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object; got {type(value).__name__}")
    return value


def _sequence(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"{what} must be a JSON list; got {type(value).__name__}")
    return value


def _number(value: Any, what: str) -> float:
    """A JSON number (or a numeric string, as int64 values are written) as a finite float."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{what} must be a number; got {value!r:.40}")
    try:
        number = float(value)
    except (ValueError, OverflowError):
        raise ValueError(f"{what} must be a number; got {value!r:.40}") from None
    if not math.isfinite(number):
        raise ValueError(f"{what} must be finite; got {value!r:.40}")
    return number


def _count(value: Any, what: str) -> int:
    """A bucket count: a whole number from 0 to int64's largest, or such a string."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{what} must be a whole number; got {value!r:.40}")
    try:
        count = int(value) if not isinstance(value, str) or len(value) <= 20 else -1
    except ValueError:
        raise ValueError(f"{what} must be a whole number; got {value!r:.40}") from None
    if not 0 <= count <= _MAX_COUNT:
        raise ValueError(f"{what} must be a whole number from 0 to 2^63-1; got {value!r:.40}")
    return count


def _from_bench(document: Any, publisher: str, source: str, max_publishes: int) -> LatencySamples:
    samples = _mapping(document, source).get("samples")
    if not samples:
        raise ValueError(f"{source} holds no per-publish samples (written by hedgepub bench since samples)")
    samples = _mapping(samples, f"{source}: samples")
    if publisher not in samples:
        raise ValueError(f"{source} has no publisher {publisher!r}; it has {', '.join(map(str, samples))}")
    entry = _mapping(samples[publisher], f"{source}: samples.{publisher}")
    raw = _sequence(entry.get("latency_ms"), f"{source}: samples.{publisher}.latency_ms")
    if len(raw) > max_publishes:
        raise _too_many(source, len(raw), max_publishes)
    what = f"{source}: samples.{publisher}.latency_ms"
    latencies = tuple(_number(value, what) / 1000.0 for value in raw)
    sent = entry.get("sent_at_s")
    if sent is not None:
        what = f"{source}: samples.{publisher}.sent_at_s"
        sent = tuple(_number(value, what) for value in _sequence(sent, what))
    return LatencySamples(latencies, sent or None, f"{source} ({publisher})")


def _too_many(source: str, count: int | str, limit: int) -> ValueError:
    return ValueError(
        f"{source} holds {count} latencies, more than the {limit:,} read (the replay's time grows with "
        "them): give a shorter span, or a larger --max-publishes"
    )


#: CSV columns read as latency, by unit; the first present wins.
_LATENCY_COLUMNS = {"latency_ms": 1e-3, "latency_s": 1.0, "latency_us": 1e-6, "latency": 1e-3}
_SENT_COLUMNS = ("sent_at_s", "timestamp_s", "sent_at")


def _lines(stream: IO[str], source: str) -> Iterator[str]:
    """The lines of ``stream``, each read with a bound: a longer one is refused."""
    number = 0
    while True:
        line = stream.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        number += 1
        if len(line) > MAX_LINE_BYTES:
            raise ValueError(f"{source}, line {number}: longer than {MAX_LINE_BYTES:,} characters")
        yield line


def _from_csv(stream: IO[str], source: str, max_publishes: int = MAX_PUBLISHES) -> LatencySamples:
    """A header row naming ``latency_ms`` (or ``latency_s``, ``latency_us``) and optionally
    ``sent_at_s``; or no header and one latency in milliseconds per line. Read a line at a time."""
    rows = (row for row in csv.reader(_lines(stream, source)) if row and any(cell.strip() for cell in row))
    latencies: list[float] = []
    sent: list[float] = []
    try:
        first = next(rows, None)
        if first is None:
            raise ValueError(f"{source}: empty CSV")
        header = [cell.strip().lower() for cell in first]
        named = [(header.index(name), unit) for name, unit in _LATENCY_COLUMNS.items() if name in header]
        column, scale = named[0] if named else (0, 1e-3)
        sent_column = next((header.index(name) for name in _SENT_COLUMNS if name in header), None)
        if not named:
            try:
                float(first[0])
            except ValueError:
                raise ValueError(
                    f"{source}: no latency column: name one latency_ms, latency_s or latency_us"
                ) from None
            body: Iterator[list[str]] = _chain(first, rows)
        else:
            body = rows
        for number, row in enumerate(body, start=1 if not named else 2):
            if len(latencies) == max_publishes:
                raise _too_many(source, f"more than {max_publishes:,}", max_publishes)
            try:
                latencies.append(_number(row[column], "latency") * scale)
                if sent_column is not None:
                    sent.append(_number(row[sent_column], "sent_at_s"))
            except (ValueError, IndexError):
                raise ValueError(f"{source}, line {number}: not a finite number: {row!r:.80}") from None
    except csv.Error as error:
        raise ValueError(f"{source}: not a CSV ({error})") from None
    return LatencySamples(tuple(latencies), tuple(sent) if sent_column is not None else None, source)


def _chain(first: list[str], rest: Iterator[list[str]]) -> Iterator[list[str]]:
    yield first
    yield from rest


def _bucket_bounds(options: Any) -> list[float]:
    """Upper bounds of the finite buckets of Cloud Monitoring ``bucketOptions``, checked."""
    options = _mapping(options, "bucketOptions")
    if "explicitBuckets" in options:
        raw = _sequence(_mapping(options["explicitBuckets"], "explicitBuckets").get("bounds", []), "bounds")
        if len(raw) > MAX_BUCKETS:
            raise ValueError(f"explicitBuckets: more than {MAX_BUCKETS:,} bounds ({len(raw):,})")
        bounds = [_number(bound, "explicitBuckets.bounds") for bound in raw]
        if any(b <= a for a, b in itertools.pairwise(bounds)):
            raise ValueError("explicitBuckets.bounds must increase")
        return bounds
    for name in ("exponentialBuckets", "linearBuckets"):
        if name not in options:
            continue
        spec = _mapping(options[name], name)
        count = _number(spec.get("numFiniteBuckets"), f"{name}.numFiniteBuckets")
        if count != int(count) or not 1 <= count <= MAX_BUCKETS:
            raise ValueError(f"{name}.numFiniteBuckets must be a whole number from 1 to {MAX_BUCKETS:,}")
        if name == "exponentialBuckets":
            growth = _number(spec.get("growthFactor"), "growthFactor")
            scale = _number(spec.get("scale"), "scale")
            if growth <= 1 or scale <= 0:
                raise ValueError("exponentialBuckets needs growthFactor > 1 and scale > 0")
            # the largest bound first: growth ** count may overflow a float
            if math.log(scale) + int(count) * math.log(growth) > math.log(1e300):
                raise ValueError(f"exponentialBuckets: scale x growthFactor^{int(count)} overflows")
            return [scale * growth**index for index in range(int(count) + 1)]
        width = _number(spec.get("width"), "width")
        offset = _number(spec.get("offset"), "offset")
        if width <= 0:
            raise ValueError("linearBuckets needs width > 0")
        bounds = [offset + width * index for index in range(int(count) + 1)]
        if not math.isfinite(bounds[-1]):
            raise ValueError("linearBuckets: offset + width x numFiniteBuckets overflows")
        return bounds
    raise ValueError(f"unknown bucketOptions: {sorted(options)[:5]}")


class _Histogram:
    """Bucket counts merged over every point of an export: ``(low, high)`` (``high`` ``None`` for the
    overflow bucket) to a count, in the input's unit, at most :data:`MAX_BUCKETS` distinct buckets."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.counts: dict[tuple[float, float | None], int] = {}

    def add(self, bounds: Sequence[float], counts: Sequence[int]) -> None:
        """One point: ``counts[0]`` below ``bounds[0]``, ``counts[i]`` in ``[bounds[i-1], bounds[i])``,
        ``counts[len(bounds)]`` above the last (trailing empty buckets may be left out)."""
        if len(counts) > len(bounds) + 1:
            raise ValueError(f"{self.source}: {len(counts):,} bucket counts for {len(bounds):,} bounds")
        for index, count in enumerate(counts):
            if count <= 0:
                continue
            low = bounds[index - 1] if index > 0 else min(0.0, bounds[0]) if bounds else 0.0
            key = (low, bounds[index] if index < len(bounds) else None)
            self.counts[key] = self.counts.get(key, 0) + count
            if len(self.counts) > MAX_BUCKETS:
                raise ValueError(f"{self.source}: more than {MAX_BUCKETS:,} distinct histogram buckets")

    def expand(self, scale: float) -> list[float]:
        return _expand(self.counts, scale)


def expand_histogram(bounds: Sequence[float], counts: Sequence[int], scale: float) -> list[float]:
    """Samples (seconds) spread through each bucket of a histogram: ``counts[0]`` below ``bounds[0]``,
    ``counts[i]`` in ``[bounds[i-1], bounds[i])``, the last above ``bounds[-1]``; values times ``scale``.

    Values are spaced evenly inside a bucket (geometrically where the bucket starts above zero), and
    the overflow bucket is placed at its lower bound (the export says no more). Counts are scaled down
    alike above :data:`MAX_DISTRIBUTION_SAMPLES`.
    """
    histogram = _Histogram("the histogram")
    histogram.add(bounds, counts)
    return histogram.expand(scale)


def _expand(buckets: Mapping[tuple[float, float | None], int], scale: float) -> list[float]:
    total = sum(buckets.values())
    factor = min(1.0, MAX_DISTRIBUTION_SAMPLES / total) if total else 1.0
    values: list[float] = []
    # Scaled with a running sum, so that the samples add up to round(total x factor) whatever the
    # number of buckets: a bucket keeps at least one sample while there are fewer buckets than samples.
    running, given = 0, 0
    ordered = sorted(
        buckets.items(), key=lambda item: (item[0][0], math.inf if item[0][1] is None else item[0][1])
    )
    for (low, high), count in ordered:
        running += count
        share = round(running * factor) - given
        if share <= 0 and len(ordered) <= MAX_DISTRIBUTION_SAMPLES:
            share = 1
        if share <= 0:
            continue
        given += share
        for step in range(share):
            position = (step + 0.5) / share
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
    if isinstance(document, list):
        series_list = document
    else:
        series_list = _sequence(_mapping(document, source).get("timeSeries", []), f"{source}: timeSeries")
    by_unit: dict[float, _Histogram] = {}
    for number, series in enumerate(series_list):
        where = f"{source}: timeSeries[{number}]"
        series = _mapping(series, where)
        scale = _UNITS.get(str(series.get("unit", "us")), 1e-6)
        histogram = by_unit.setdefault(scale, _Histogram(source))
        for index, point in enumerate(_sequence(series.get("points", []), f"{where}.points")):
            value = _mapping(_mapping(point, f"{where}.points[{index}]").get("value", {}), "value")
            distribution = value.get("distributionValue")
            if not distribution:
                continue
            distribution = _mapping(distribution, "distributionValue")
            raw = _raw_counts(distribution.get("bucketCounts", []), "bucketCounts")
            if not raw:
                continue
            if len(raw) > MAX_BUCKETS + 2:
                raise ValueError(f"{where}.points[{index}]: more than {MAX_BUCKETS:,} buckets")
            counts = _counts(raw, "bucketCounts")
            try:
                bounds = _bucket_bounds(distribution.get("bucketOptions", {}))
            except ValueError as error:
                raise ValueError(f"{where}.points[{index}]: {error}") from None
            histogram.add(bounds, counts)
    values = _merged(by_unit)
    return LatencySamples(tuple(values), None, f"{source} (Cloud Monitoring distribution)")


def _merged(by_unit: Mapping[float, _Histogram]) -> list[float]:
    """The histograms of every unit, in seconds, expanded as one (the sample budget shared)."""
    if len(by_unit) == 1:
        ((unit, histogram),) = by_unit.items()
        return histogram.expand(unit)
    combined = _Histogram("the export")
    for unit, histogram in by_unit.items():
        for (low, high), count in histogram.counts.items():
            key = (low * unit, None if high is None else high * unit)
            combined.counts[key] = combined.counts.get(key, 0) + count
    return combined.expand(1.0)


def _camel_or_snake(entry: Mapping[str, Any], camel: str, snake: str, default: Any = None) -> Any:
    return entry.get(camel, entry.get(snake, default))


def _attributes(point: Mapping[str, Any]) -> dict[str, Any]:
    raw = point.get("attributes", {})
    if isinstance(raw, dict):  # the Python SDK's to_json
        return raw
    out = {}
    for item in _sequence(raw, "attributes"):  # OTLP JSON: [{"key": ..., "value": {"stringValue": ...}}]
        item = _mapping(item, "attribute")
        value = item.get("value", {})
        out[str(item.get("key"))] = (
            next(iter(value.values()), None) if isinstance(value, dict) and value else None
        )
    return out


def _from_otel(document: Any, source: str) -> LatencySamples:
    """``hedgepub.publish.latency`` data points with ``hedgepub.outcome`` ``ok`` (all when unlabelled)."""
    by_unit: dict[float, _Histogram] = {}
    document = _mapping(document, source)
    for resource in _sequence(
        _camel_or_snake(document, "resourceMetrics", "resource_metrics", []), "resourceMetrics"
    ):
        resource = _mapping(resource, "resourceMetrics[]")
        for scope in _sequence(
            _camel_or_snake(resource, "scopeMetrics", "scope_metrics", []), "scopeMetrics"
        ):
            for metric in _sequence(_mapping(scope, "scopeMetrics[]").get("metrics", []), "metrics"):
                metric = _mapping(metric, "metric")
                if metric.get("name") != OTEL_LATENCY_METRIC:
                    continue
                scale = _UNITS.get(str(metric.get("unit", "s")), 1.0)
                histogram = by_unit.setdefault(scale, _Histogram(source))
                data = _mapping(metric.get("histogram") or metric.get("data") or {}, "histogram")
                for point in _sequence(_camel_or_snake(data, "dataPoints", "data_points", []), "dataPoints"):
                    point = _mapping(point, "dataPoint")
                    if _attributes(point).get("hedgepub.outcome", "ok") != "ok":
                        continue
                    raw_bounds = _sequence(
                        _camel_or_snake(point, "explicitBounds", "explicit_bounds", []), "explicitBounds"
                    )
                    raw_counts = _raw_counts(
                        _camel_or_snake(point, "bucketCounts", "bucket_counts", []), "bucketCounts"
                    )
                    if len(raw_bounds) > MAX_BUCKETS or len(raw_counts) > MAX_BUCKETS + 1:
                        raise ValueError(f"{source}: a data point of more than {MAX_BUCKETS:,} buckets")
                    bounds = [_number(bound, "explicitBounds") for bound in raw_bounds]
                    if any(b <= a for a, b in itertools.pairwise(bounds)):
                        raise ValueError(f"{source}: explicitBounds must increase")
                    histogram.add(bounds, _counts(raw_counts, "bucketCounts"))
    values = _merged(by_unit)
    if not values:
        raise ValueError(f"{source}: no {OTEL_LATENCY_METRIC} histogram points with outcome ok")
    return LatencySamples(tuple(values), None, f"{source} ({OTEL_LATENCY_METRIC})")
