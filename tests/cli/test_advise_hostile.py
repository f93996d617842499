"""``hedgepub advise`` on hostile inputs: each refused with exit 1 and a message saying why, in bounded
memory and time (never a traceback, never a run that does not end), and a fuzz of its parsers."""

from __future__ import annotations

import json
import string
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hedgepub.bench import load_latencies
from hedgepub.bench._latencies import MAX_BUCKETS, MAX_JSON_BYTES


def _bench(sent: list[object], latencies: list[object]) -> str:
    return json.dumps({"results": [], "samples": {"unhedged": {"sent_at_s": sent, "latency_ms": latencies}}})


def _monitoring(options: dict[str, object], counts: list[str]) -> str:
    point = {"value": {"distributionValue": {"bucketOptions": options, "bucketCounts": counts}}}
    return json.dumps({"timeSeries": [{"unit": "us", "points": [point]}]})


HOSTILE = {
    "sent-inf": (
        "results.json",
        _bench([0, "Infinity", 2], [5, 5, 5]).replace('"Infinity"', "Infinity"),
        "finite",
    ),
    "sent-1e300": ("results.json", _bench([0, 1e300, 2], [5, 5, 5]), "send times"),
    "latency-nan": ("results.json", _bench([0, 1, 2], [5, "x", 5]), "must be a number"),
    "buckets-30M": (
        "export.json",
        _monitoring(
            {"exponentialBuckets": {"numFiniteBuckets": 30_000_000, "growthFactor": 2, "scale": 1}}, ["1"]
        ),
        "numFiniteBuckets",
    ),
    "growth-overflow": (
        "export.json",
        _monitoring(
            {"exponentialBuckets": {"numFiniteBuckets": 2000, "growthFactor": 1e10, "scale": 1}}, ["1"]
        ),
        "overflows",
    ),
    "deep": ("deep.json", "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    "count-huge": (
        "export.json",
        _monitoring({"explicitBuckets": {"bounds": [1, 2]}}, ["1" + "0" * 30]),
        "2^63-1",
    ),
    "wrong-types": ("export.json", json.dumps({"timeSeries": [5]}), "JSON object"),
}


_PEAK_RSS = (
    "import resource, sys\n"
    "from hedgepub.bench import load_latencies\n"
    "if sys.argv[1:]:\n"
    "    print(len(load_latencies(sys.argv[1]).latencies_s))\n"
    "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)\n"
)


def _peak_rss(*args: str) -> list[int]:
    """What a fresh interpreter printed reading ``args`` with load_latencies, then its peak RSS (bytes)."""
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS, *args], capture_output=True, text=True, check=True
    )
    return [int(line) for line in done.stdout.split()]


def test_a_large_export_is_read_in_a_few_times_its_size(tmp_path: Path) -> None:
    # Bucket counts are int64 strings in an export: parsed as a list of strings, they took 14 times the
    # export's size (a 30 MiB one of 6 million counts peaked 460 MiB above the interpreter's start).
    # An eighth of the size limit here, for the test's time.
    buckets = MAX_BUCKETS - 2
    counts = ",".join(f'"{10 + index % 89}"' for index in range(buckets + 2))
    options = json.dumps(
        {"exponentialBuckets": {"numFiniteBuckets": buckets, "growthFactor": 1.0001, "scale": 100}}
    )
    point = f'{{"value":{{"distributionValue":{{"bucketOptions":{options},"bucketCounts":[{counts}]}}}}}}'
    points = MAX_JSON_BYTES // 8 // (len(point) + 1)
    export = tmp_path / "export.json"
    export.write_text(f'{{"timeSeries":[{{"unit":"us","points":[{",".join([point] * points)}]}}]}}')
    size = export.stat().st_size
    assert MAX_JSON_BYTES / 10 < size <= MAX_JSON_BYTES / 8
    [start] = _peak_rss()
    samples, peak = _peak_rss(str(export))
    assert samples == 20_000
    assert peak - start < 5 * size, (peak - start) / size


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_file_is_refused_with_exit_1_and_why(case: str, hedgepub_cli, tmp_path: Path) -> None:
    name, text, why = HOSTILE[case]
    path = tmp_path / name
    path.write_text(text)
    result = hedgepub_cli("advise", str(path), "--out", str(tmp_path / "out"))
    assert result.exit_code == 1, result.output
    assert "cannot read latencies" in result.output and why in result.output, result.output


def test_a_csv_longer_than_max_publishes_is_refused_after_reading_that_many(
    hedgepub_cli, tmp_path: Path
) -> None:
    path = tmp_path / "long.csv"
    with path.open("w") as out:  # 2,000,000 lines; read a line at a time, refused at the 1,001st row
        out.write("latency_ms\n")
        out.writelines("5\n" for _ in range(2_000_000))
    result = hedgepub_cli("advise", str(path), "--max-publishes", "1000", "--out", str(tmp_path / "out"))
    assert result.exit_code == 1 and "more than 1,000" in result.output, result.output
    line = tmp_path / "line.csv"
    line.write_text("latency_ms\n" + "5" * 200_000 + "\n")
    result = hedgepub_cli("advise", str(line), "--out", str(tmp_path / "out"))
    assert result.exit_code == 1 and "longer than" in result.output, result.output


@pytest.mark.parametrize("rate", ["nan", "inf", "-1", "1e300"])
def test_a_rate_that_is_not_a_finite_positive_number_is_bad_usage(
    rate: str, hedgepub_cli, tmp_path: Path
) -> None:
    path = tmp_path / "l.csv"
    path.write_text("latency_ms\n5\n6\n")
    result = hedgepub_cli("advise", str(path), "--rate", rate, "--out", str(tmp_path / "out"))
    assert result.exit_code == 2, result.output
    for option in ("--delays", "--max-extra-rpcs"):
        result = hedgepub_cli("advise", str(path), option, "nan", "--out", str(tmp_path / "out"))
        assert result.exit_code == 2, result.output


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(
        st.sampled_from(
            ["timeSeries", "points", "value", "distributionValue", "bucketOptions", "bucketCounts",
             "exponentialBuckets", "linearBuckets", "explicitBuckets", "bounds", "numFiniteBuckets",
             "growthFactor", "scale", "width", "offset", "unit", "samples", "unhedged", "latency_ms",
             "sent_at_s", "results", "resourceMetrics", "scopeMetrics", "metrics", "name", "histogram",
             "dataPoints", "explicitBounds", "attributes"]
        ) | st.text(max_size=4),
        children,
        max_size=5,
    ),
    max_leaves=30,
)  # fmt: skip


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(document=_json, kind=st.sampled_from(["auto", "bench", "monitoring", "otel"]))
def test_fuzz_json_inputs_give_latencies_or_a_value_error(
    document: object, kind: str, tmp_path: Path
) -> None:
    path = tmp_path / "fuzz.json"
    path.write_text(json.dumps(document))
    try:
        samples = load_latencies(path, kind)  # type: ignore[arg-type]
    except ValueError:
        return
    assert samples.latencies_s and len(samples.latencies_s) <= 200_000


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=string.digits + ',.-\n\r"e' + "latency_msent", max_size=200))
def test_fuzz_csv_inputs_give_latencies_or_a_value_error(text: str, tmp_path: Path) -> None:
    path = tmp_path / "fuzz.csv"
    path.write_text(text)
    try:
        samples = load_latencies(path)
    except ValueError:
        return
    assert all(0 <= value <= 86_400 for value in samples.latencies_s)
