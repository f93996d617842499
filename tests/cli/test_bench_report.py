"""The bench's pure parts: schedule, percentiles, the results document, table and plot."""

from __future__ import annotations

import io
import itertools
import json
import math
import random
import statistics
import struct
import zlib

import pytest
from rich.console import Console

from hedgepub.bench import (
    LABEL_GID,
    RESULT_KEYS,
    BenchConfig,
    LatencyRecorder,
    PublisherResult,
    arrival_times,
    build_table,
    latency_cdf_figure,
    pair_orders,
    plot_latency_cdf,
    print_report,
    render_markdown,
    results_document,
    write_results_json,
)
from hedgepub.bench._report import format_ms

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _mixed_latencies(count: int, seed: int) -> list[float]:
    """Seconds drawn from 95% ~5 ms, 4% 300 ms, 1% 4 s."""
    rng = random.Random(seed)
    values = []
    for _ in range(count):
        draw = rng.random()
        values.append(0.005 + rng.random() / 1000 if draw < 0.95 else 0.3 if draw < 0.99 else 4.0)
    return values


def _result(recorder: LatencyRecorder, **overrides: int) -> PublisherResult:
    counts = {
        "failed": 0,
        "attempts_sent": recorder.count,
        "hedges_sent": 0,
        "hedges_won": 0,
        "duplicates": 0,
    }
    counts.update(overrides)
    return PublisherResult.from_measurements(recorder, **counts)


def _document() -> dict:
    unhedged, hedged = LatencyRecorder(), LatencyRecorder()
    for seconds in _mixed_latencies(2000, 1):
        unhedged.record(seconds)
    for seconds in _mixed_latencies(2000, 2):
        hedged.record(min(seconds, 0.106))
    results = {
        "unhedged": _result(unhedged),
        "hedged": _result(hedged, attempts_sent=2100, hedges_sent=100, hedges_won=95, duplicates=1),
    }
    return results_document({"messages": 2000, "rate": 40.0}, results)


class TestSchedule:
    def test_poisson_arrivals_are_increasing_seeded_and_at_the_rate(self) -> None:
        times = arrival_times(4000, 40.0, seed=3)
        assert times == arrival_times(4000, 40.0, seed=3)
        assert times != arrival_times(4000, 40.0, seed=4)
        assert times[0] == 0.0
        assert all(later > earlier for earlier, later in itertools.pairwise(times))
        gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
        assert statistics.fmean(gaps) == pytest.approx(1 / 40, rel=0.06)
        # exponential gaps: their standard deviation equals their mean
        assert statistics.pstdev(gaps) == pytest.approx(1 / 40, rel=0.1)

    def test_fixed_arrivals_are_evenly_spaced(self) -> None:
        assert arrival_times(4, 2.0, arrivals="fixed") == [0.0, 0.5, 1.0, 1.5]

    @pytest.mark.parametrize(
        ("count", "rate", "arrivals"), [(-1, 1.0, "fixed"), (1, 0.0, "fixed"), (1, 1, "x")]
    )
    def test_bad_schedules_are_refused(self, count: int, rate: float, arrivals: str) -> None:
        with pytest.raises(ValueError):
            arrival_times(count, rate, arrivals=arrivals)  # type: ignore[arg-type]

    def test_every_publisher_publishes_at_every_arrival_in_shuffled_order(self) -> None:
        orders = pair_orders(1000, ("unhedged", "hedged"), seed=1)
        assert all(sorted(order) == ["hedged", "unhedged"] for order in orders)
        firsts = sum(order[0] == "hedged" for order in orders)
        assert 400 < firsts < 600


class TestRecorder:
    def test_percentiles_match_the_exact_ones_within_a_tenth_of_a_percent(self) -> None:
        values = _mixed_latencies(5000, 7)
        recorder = LatencyRecorder()
        for seconds in values:
            recorder.record(seconds)
        ordered = sorted(value * 1000 for value in values)
        for percentile in (50, 90, 99, 99.9):
            exact = ordered[math.ceil(len(ordered) * percentile / 100) - 1]
            assert recorder.percentile_ms(percentile) == pytest.approx(exact, rel=1e-3)
        assert recorder.max_ms() == pytest.approx(4000, rel=1e-3)
        assert recorder.count == 5000

    def test_an_empty_recorder_reports_nan_and_json_null(self) -> None:
        result = _result(LatencyRecorder(), failed=3, attempts_sent=3)
        assert math.isnan(result.p99_ms)
        entry = result.to_dict()
        assert entry["p99_ms"] is None
        assert entry["published"] == 0
        assert entry["failed"] == 3
        assert entry["attempts_per_publish"] == 1.0


class TestDocument:
    def test_the_document_has_config_and_both_results_with_every_key(self, tmp_path) -> None:
        document = _document()
        assert list(document) == ["config", "results"]
        assert list(document["results"]) == ["unhedged", "hedged"]
        for entry in document["results"].values():
            assert list(entry) == list(RESULT_KEYS)
        hedged = document["results"]["hedged"]
        assert hedged["attempts_per_publish"] == pytest.approx(1.05)
        assert hedged["p99_ms"] < document["results"]["unhedged"]["p99_ms"]
        path = write_results_json(document, tmp_path / "deep" / "results.json")
        assert json.loads(path.read_text()) == document

    def test_a_missing_publisher_is_refused(self) -> None:
        with pytest.raises(ValueError, match="at least one hedged"):
            results_document({}, {"unhedged": _result(LatencyRecorder())})
        with pytest.raises(ValueError, match="'unhedged'"):
            results_document({}, {"hedged": _result(LatencyRecorder()), "other": _result(LatencyRecorder())})

    def test_any_number_of_publishers_is_a_column_each_unhedged_first(self) -> None:
        recorders = {name: LatencyRecorder() for name in ("fixed-100ms", "unhedged", "adaptive")}
        for seed, recorder in enumerate(recorders.values()):
            for seconds in _mixed_latencies(500, seed):
                recorder.record(seconds)
        delays = {"unhedged": None, "fixed-100ms": 100.0, "adaptive": 123.4}
        results = {
            name: _result(recorder, hedge_delay_ms=delays[name]) for name, recorder in recorders.items()
        }  # type: ignore[arg-type]
        document = results_document({}, results)
        assert list(document["results"]) == ["unhedged", "fixed-100ms", "adaptive"]
        assert document["results"]["adaptive"]["hedge_delay_ms"] == 123.4
        lines = render_markdown(document).splitlines()
        assert lines[0] == "| measure | unhedged | fixed-100ms | adaptive |"
        assert lines[1] == "|---|---:|---:|---:|"
        assert "| hedge delay (ms) | - | 100 | 123 |" in lines
        assert all(line.count("|") == 5 for line in lines)

    def test_the_table_shows_every_measure_and_the_ratios(self) -> None:
        document = _document()
        output = io.StringIO()
        print_report(document, Console(file=output, width=120, color_system=None))
        text = output.getvalue()
        for label in (
            "p50",
            "p90",
            "p99 ",
            "p99.9",
            "max",
            "attempts per publish",
            "hedges sent",
            "hedges won",
        ):
            assert label in text
        assert "duplicates on server" in text
        assert "failed" in text
        p99 = document["results"]["hedged"]["p99_ms"] / document["results"]["unhedged"]["p99_ms"]
        assert f"({p99:.2f}x)" in text
        assert "hedge delay (ms)" in text
        assert "duplicates after dedup" in text
        # hedges that all went to the primary need no per-endpoint rows
        assert "hedges to" not in text
        assert build_table(document).row_count == 13

    def test_the_markdown_table_has_a_header_and_one_line_per_measure(self) -> None:
        lines = render_markdown(_document()).splitlines()
        assert lines[0] == "| measure | unhedged | hedged |"
        assert len(lines) == 15
        assert all(line.startswith("|") and line.endswith("|") for line in lines)


class TestPlot:
    def test_the_plot_is_a_valid_png(self, tmp_path) -> None:
        latencies = {
            "unhedged": [seconds * 1000 for seconds in _mixed_latencies(2000, 1)],
            "hedged": [min(seconds, 0.106) * 1000 for seconds in _mixed_latencies(2000, 2)],
        }
        path = plot_latency_cdf(latencies, tmp_path / "plots" / "tail-latency.png", subtitle="a test")
        data = path.read_bytes()
        assert data.startswith(PNG_SIGNATURE)
        assert len(data) > 20_000
        length, kind = struct.unpack(">I4s", data[8:16])
        assert kind == b"IHDR"
        assert zlib.crc32(data[12 : 16 + length]) == struct.unpack(">I", data[16 + length : 20 + length])[0]
        width, height = struct.unpack(">II", data[16:24])
        assert width > 500 and height > 300

    def test_a_publisher_without_latencies_is_left_out(self, tmp_path) -> None:
        path = plot_latency_cdf({"unhedged": [], "hedged": [1.0, 2.0, 3.0]}, tmp_path / "p.png")
        assert path.read_bytes().startswith(PNG_SIGNATURE)


class TestConfig:
    def test_defaults_take_about_a_minute_and_fill_the_bucket(self) -> None:
        config = BenchConfig()
        assert 40 <= config.expected_seconds() <= 60
        assert config.warmup_target() == 500  # 50 tokens at 0.1 per success
        unhedged, fixed, adaptive = config.publishers()
        assert (unhedged.name, unhedged.hedging) == ("unhedged", None)
        assert fixed.name == "fixed-100ms" and fixed.hedging.hedge_delay == 0.1  # type: ignore[union-attr]
        assert adaptive.name == "adaptive" and adaptive.hedging.adaptive_delay is not None  # type: ignore[union-attr]
        p90 = BenchConfig(hedge_delays=("auto", "auto:90")).publishers()[2]
        assert p90.name == "adaptive-p90" and p90.hedging.adaptive_delay.percentile == 90  # type: ignore[union-attr]

    @pytest.mark.parametrize(
        ("field", "value", "message"),
        [
            ("hedge_delays", (0.05,), "hedge_delay"),
            ("hedge_delays", ("fast",), "'auto'"),
            ("hedge_delays", ("auto:high",), "must be a number"),
            ("hedge_delays", ("auto:40",), "percentile"),
            ("hedge_delays", (), "at least one"),
            ("hedge_delays", (0.1, 0.1), "must not repeat"),
            ("max_tokens", 0, "max_tokens"),
            ("refill_ratio", 0.5, "refill_ratio"),
            ("messages", 0, "messages"),
            ("rate", 0.0, "rate"),
            ("warmup", -1, "warmup"),
        ],
    )
    def test_bad_settings_are_refused_naming_the_field(self, field: str, value: object, message: str) -> None:
        with pytest.raises(ValueError, match=message):
            BenchConfig(**{field: value})


def _labels(figure) -> list:
    """The texts of the plot's percentile table."""
    from matplotlib.text import Text

    return [text for text in figure.findobj(Text) if text.get_gid() == LABEL_GID]


def _text_boxes(figure) -> list[tuple[str, object]]:
    """(text, window extent) of every non-empty visible text the figure draws."""
    renderer = figure.canvas.get_renderer()
    figure.draw(renderer)  # lays out ticks and their labels as they are saved
    axes = figure.axes[0]
    drawn = [*axes.get_xticklabels(), *axes.get_yticklabels(), axes.xaxis.label, axes.yaxis.label]
    legend = axes.get_legend()
    if legend is not None:
        drawn += legend.get_texts()
    drawn += _labels(figure)
    drawn += figure.texts
    return [
        (text.get_text(), text.get_window_extent(renderer))
        for text in drawn
        if text.get_visible() and text.get_text().strip()
    ]


#: Three latency shapes: the README's mix, a short run's two tiers, and three publishers that nearly tie.
_PLOT_CASES = {
    "go-mix": {
        "unhedged": [seconds * 1000 for seconds in _mixed_latencies(2000, 1)],
        "hedged": [min(seconds, 0.106) * 1000 for seconds in _mixed_latencies(2000, 2)],
    },
    "short-two-tier": {
        "unhedged": [1.2 + (i % 7) / 10 if i % 10 else 1000.0 + i % 5 for i in range(500)],
        "hedged": [1.2 + (i % 7) / 10 if i % 10 else 101.5 + i % 3 for i in range(500)],
    },
    "three-close": {
        name: [5.0 + (i % 13) / 10 + shift if i % 50 else 300.0 + shift for i in range(1000)]
        for name, shift in (("unhedged", 0.0), ("hedged", 0.1), ("adaptive", 0.2))
    },
    "six-long-names": {
        name: [5.0 + (i % 13) / 10 + index if i % 20 else 1234.5 + index for i in range(400)]
        for index, name in enumerate(
            ("unhedged", "fixed-100ms", "fixed-1000ms", "adaptive", "cross_endpoint", "fixed-250ms")
        )
    },
}


class TestPlotLabels:
    @pytest.mark.parametrize("case", sorted(_PLOT_CASES))
    def test_no_two_texts_overlap_and_no_curve_crosses_a_label(self, case: str) -> None:
        import matplotlib.pyplot as plt

        latencies = _PLOT_CASES[case]
        subtitle = "injected on Publish: 90%:1ms,10%:1s; hedge delay 100 ms; 500 publishes each at 100/s"
        figure = latency_cdf_figure(latencies, subtitle=subtitle)
        try:
            boxes = _text_boxes(figure)
            assert len(boxes) >= 4 * len(latencies) + 4  # the values, the row labels, titles, ticks
            for (first, a), (second, b) in itertools.combinations(boxes, 2):
                assert not a.padded(1).overlaps(b), f"{first!r} overlaps {second!r}"
            renderer = figure.canvas.get_renderer()
            plot_area = figure.axes[0].get_window_extent(renderer)
            labels = [
                text for text in figure.findobj() if getattr(text, "get_gid", lambda: None)() == LABEL_GID
            ]
            for label in labels:  # the curves are clipped to the axes, so outside it none can cross a label
                box = label.get_window_extent(renderer)
                assert box.x0 > plot_area.x1, f"{label.get_text()!r} lies inside the axes"
                assert box.x1 <= figure.bbox.x1 and box.y1 <= figure.bbox.y1, (
                    f"{label.get_text()!r} is cut off"
                )
        finally:
            plt.close(figure)

    def test_the_labels_show_the_numbers_of_the_table_and_json(self) -> None:
        import matplotlib.pyplot as plt

        document = _document()
        latencies = _PLOT_CASES["go-mix"]
        figure = latency_cdf_figure(latencies, results=document["results"])
        try:
            shown = {
                text.get_text()
                for text in figure.findobj()
                if getattr(text, "get_gid", lambda: None)() == LABEL_GID
            }
        finally:
            plt.close(figure)
        table = render_markdown(document)
        for name in ("unhedged", "hedged"):
            for key in ("p50_ms", "p90_ms", "p99_ms", "p999_ms"):
                value = format_ms(document["results"][name][key])
                assert f"{value} ms" in shown
                assert f"| {value} |" in table or f"| {value} (" in table  # hedged cells: "106 (0.04x)"
