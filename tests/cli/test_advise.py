"""``hedgepub advise``: its inputs, the replay through the hedging engine, the advice and its code."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest

from hedgepub import AdaptiveDelay, AsyncPublisherClient, HedgingSettings, PublisherClient
from hedgepub.bench import LatencyRecorder, LatencySamples, PublisherResult, load_latencies, replay
from hedgepub.bench._advise import grid, recommend
from hedgepub.bench._latencies import expand_histogram
from hedgepub.bench._report import results_document
from hedgepub.bench._snippets import CLIENT_SETTINGS, go_snippet, hedgepub_snippet, java_snippet, rust_snippet
from hedgepub.testing.scripted import ScriptedTransport
from hedgepub.testing.virtual_time import run_virtual

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _go_mix(count: int, seed: int = 3, rate: float = 40.0) -> LatencySamples:
    """The Go client's test mix (95% 5 ms, 4% 300 ms, 1% 4 s) on a Poisson schedule."""
    rng = random.Random(seed)
    latencies, sent, now = [], [], 0.0
    for _ in range(count):
        draw = rng.random()
        latencies.append(4.0 if draw < 0.01 else 0.3 if draw < 0.05 else 0.005)
        sent.append(now)
        now += rng.expovariate(rate)
    return LatencySamples(tuple(latencies), tuple(sent), "go mix")


def test_the_unhedged_replay_gives_back_the_measured_percentiles() -> None:
    samples = _go_mix(2000)
    prediction = replay(samples, None)
    ordered = sorted(samples.latencies_s)
    assert prediction.publishes == 2000 and prediction.failed == 0
    assert prediction.extra_rpcs == 0
    assert prediction.p99_ms == pytest.approx(ordered[1979] * 1000)
    assert prediction.p999_ms == pytest.approx(4000.0)


def test_hedging_after_100ms_cuts_the_predicted_tail_within_the_bucket() -> None:
    samples = _go_mix(2000)
    prediction = replay(samples, HedgingSettings(hedge_delay=0.1, max_tokens=50, refill_ratio=0.1))
    # a hedge after 100 ms answers in 5 ms unless it is slow too (5%): p99 is 100 ms + 5 ms
    assert prediction.p99_ms == pytest.approx(105.0)
    # about one publish in twenty is slower than 100 ms, and each gets one hedge (two if both slow)
    assert 0.04 <= prediction.extra_rpcs <= 0.06
    assert prediction.hedges_won > 0.9 * prediction.hedges_sent
    # a bucket refilled by 0.01 per publish cannot pay for 5% hedges: the tail comes back
    starved = replay(samples, HedgingSettings(hedge_delay=0.1, max_tokens=10, refill_ratio=0.01))
    assert starved.extra_rpcs < 0.02 and starved.p99_ms > 250
    # a bench run's bucket as its warm-up left it: with no tokens at the start, only the refill pays
    poor = HedgingSettings(hedge_delay=0.1, max_tokens=50, refill_ratio=0.01)
    rich, empty = replay(samples, poor, passes=1), replay(samples, poor, passes=1, initial_tokens=0)
    assert rich.hedges_sent == pytest.approx(50 + 0.01 * 2000, abs=2)
    assert empty.hedges_sent == pytest.approx(0.01 * 2000, abs=2)
    # an adaptive delay with a history: 500 latencies of 1 s keep it at 1 s until they age out (two
    # 10 s windows), so it hedges later than one that starts from 100 ms
    adaptive = HedgingSettings(max_tokens=50, refill_ratio=0.1, adaptive_delay=AdaptiveDelay())
    slow = replay(samples, adaptive, passes=1, initial_delay=(1.0, 500))
    quick = replay(samples, adaptive, passes=1, initial_delay=(0.1, 500))
    assert slow.p999_ms > quick.p999_ms and slow.hedges_sent < quick.hedges_sent


def test_the_trace_model_sends_stall_windows_to_the_hedges_too() -> None:
    # Every publish arriving in a 500 ms window of each 5 s waits until the window ends, as the bench's
    # correlated-stalls scenario makes them: a hedge sent 100 ms later is stalled as well.
    latencies, sent = [], []
    for index in range(1800):
        at = index / 40
        phase = at % 5.0
        latencies.append((0.5 - phase if phase < 0.5 else 0.0) + 0.002)
        sent.append(at)
    samples = LatencySamples(tuple(latencies), tuple(sent), "stalls")
    hedging = HedgingSettings(hedge_delay=0.1, max_tokens=50, refill_ratio=0.1)
    traced = replay(samples, hedging, model="trace")
    independent = replay(samples, hedging, model="independent", rate=40)
    unhedged = replay(samples, None)
    assert traced.p99_ms == pytest.approx(unhedged.p99_ms, rel=0.05)  # hedges into the stall do not help
    assert independent.p99_ms < 0.5 * unhedged.p99_ms  # as if the stalls struck at random: they would


def test_a_bench_results_json_is_read_per_publisher(tmp_path: Path) -> None:
    recorders = {name: LatencyRecorder() for name in ("unhedged", "fixed-100ms")}
    for index in range(50):
        recorders["unhedged"].record(0.004 + index / 1000, sent_at=index / 40)
        recorders["fixed-100ms"].record(0.003, sent_at=index / 40)
    results = {
        name: PublisherResult.from_measurements(
            recorder, failed=0, attempts_sent=50, hedges_sent=0, hedges_won=0, duplicates=0
        )
        for name, recorder in recorders.items()
    }
    document = results_document({}, results, {name: r.samples() for name, r in recorders.items()})
    path = tmp_path / "results.json"
    path.write_text(json.dumps(document))
    samples = load_latencies(path)
    assert len(samples.latencies_s) == 50 and samples.sent_at_s is not None
    assert samples.latencies_s[10] == pytest.approx(0.014)
    assert samples.rate() == pytest.approx(40.0)
    assert set(load_latencies(path, publisher="fixed-100ms").latencies_s) == {0.003}
    with pytest.raises(ValueError, match="no publisher 'adaptive'"):
        load_latencies(path, publisher="adaptive")


def test_csv_inputs_with_and_without_header(tmp_path: Path) -> None:
    named = tmp_path / "named.csv"
    named.write_text("sent_at_s,latency_ms\n0.0,5\n0.025,300\n0.05,4000\n")
    samples = load_latencies(named)
    assert samples.latencies_s == (0.005, 0.3, 4.0) and samples.sent_at_s == (0.0, 0.025, 0.05)
    seconds = tmp_path / "seconds.csv"
    seconds.write_text("latency_s\n0.005\n0.3\n")
    assert load_latencies(seconds).latencies_s == (0.005, 0.3)
    assert load_latencies(seconds).sent_at_s is None
    bare = tmp_path / "bare.txt"
    bare.write_text("5\n7.5\n")
    assert load_latencies(bare, "csv").latencies_s == (0.005, 0.0075)
    bad = tmp_path / "bad.csv"
    bad.write_text("latency_ms\n5\nslow\n")
    with pytest.raises(ValueError, match="line 3"):
        load_latencies(bad)


def test_a_cloud_monitoring_distribution_export(tmp_path: Path) -> None:
    # The shape of projects.timeSeries.list for a DISTRIBUTION metric: int64 counts as strings, the
    # bucket options of the series, and trailing empty buckets left out.
    export = {
        "timeSeries": [
            {
                "metric": {"type": "pubsub.googleapis.com/topic/send_request_latencies"},
                "resource": {"type": "pubsub_topic", "labels": {"topic_id": "orders"}},
                "metricKind": "DELTA",
                "valueType": "DISTRIBUTION",
                "unit": "us",
                "points": [
                    {
                        "interval": {"startTime": "2026-12-01T10:00:00Z", "endTime": "2026-12-01T10:01:00Z"},
                        "value": {
                            "distributionValue": {
                                "count": "100",
                                "mean": 20000,
                                "bucketOptions": {
                                    "exponentialBuckets": {
                                        "numFiniteBuckets": 30,
                                        "growthFactor": 2,
                                        "scale": 1000,
                                    }
                                },
                                # bucket 0: under 1 ms; bucket i: [1000 * 2^(i-1), 1000 * 2^i) us
                                "bucketCounts": ["0", "0", "0", "95", "4", "0", "0", "0", "0", "0", "0", "0",
                                                 "1"],
                            }
                        },
                    }
                ],
            }
        ]
    }  # fmt: skip
    path = tmp_path / "monitoring.json"
    path.write_text(json.dumps(export))
    samples = load_latencies(path)
    assert len(samples.latencies_s) == 100 and samples.sent_at_s is None
    ordered = sorted(samples.latencies_s)
    assert ordered[0] >= 0.004 and ordered[94] < 0.008  # 95 in [4 ms, 8 ms)
    assert all(0.008 <= value < 0.016 for value in ordered[95:99])
    assert 2.048 <= ordered[99] < 4.096
    # an explicit-bucket series and the overflow bucket
    assert expand_histogram([1.0, 2.0], [1, 2, 1], 1.0) == [
        0.5,
        pytest.approx(2**0.25),
        pytest.approx(2**0.75),
        2.0,
    ]


def test_hedgepubs_own_opentelemetry_metrics(tmp_path: Path) -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View

    # the buckets an application gives the latency histogram (the SDK's defaults are for milliseconds)
    bounds = [0.001 * 2**power for power in range(14)]
    reader = InMemoryMetricReader()
    view = View(
        instrument_name="hedgepub.publish.latency", aggregation=ExplicitBucketHistogramAggregation(bounds)
    )
    provider = MeterProvider(metric_readers=[reader], views=[view])
    transport = ScriptedTransport()
    transport.script.extend([transport.ok(delay=0.005)] * 95 + [transport.ok(delay=0.3)] * 5)

    async def publish() -> None:
        client = AsyncPublisherClient(
            transport=transport, enable_open_telemetry=True, meter_provider=provider
        )
        for index in range(100):
            await client.publish("projects/p/topics/t", b"%d" % index)
        await client.shutdown()

    run_virtual(publish())
    data = reader.get_metrics_data()
    assert data is not None
    path = tmp_path / "otel.json"
    path.write_text(data.to_json())
    provider.shutdown()
    samples = load_latencies(path)
    assert len(samples.latencies_s) == 100
    ordered = sorted(samples.latencies_s)
    assert 0.004 <= ordered[94] < 0.008 and 0.256 <= ordered[95] < 0.512


def test_the_printed_hedgepub_code_constructs_those_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", "127.0.0.1:9")  # nothing is published
    for settings in (
        HedgingSettings(hedge_delay=0.2, max_tokens=50, refill_ratio=0.05),
        HedgingSettings(max_tokens=10, refill_ratio=0.2, adaptive_delay=AdaptiveDelay(percentile=99.0)),
    ):
        namespace: dict[str, object] = {}
        exec(hedgepub_snippet(settings), namespace)  # the snippet is our own output
        publisher = namespace["publisher"]
        assert isinstance(publisher, PublisherClient)
        assert namespace["hedging"] == settings
        publisher.shutdown()


def test_the_other_clients_code_uses_their_setting_names_and_ranges() -> None:
    settings = HedgingSettings(hedge_delay=0.25, max_tokens=250, refill_ratio=0.001)
    # names as the clients' sources spell them (google-cloud-java HedgingSettings.Builder, google-cloud-go
    # pubsub/v2 hedging.go, google-cloud-rust src/pubsub publisher/options.rs)
    java, go, rust = java_snippet(settings), go_snippet(settings), rust_snippet(settings)
    assert "HedgingSettings.newBuilder()" in java and ".setHedgingSettings(hedgingSettings)" in java
    assert ".setHedgeDelay(Duration.ofMillis(250))" in java and ".setMaxTokens(250)" in java
    assert ".setRefillRatio(0.001f)" in java
    assert "publisher.PublishSettings.HedgingSettings = &pubsub.HedgingSettings{" in go
    assert "Delay:       250 * time.Millisecond," in go and "MaxTokens:   250," in go
    assert "RefillRatio: 0.001," in go
    assert ".set_hedging_options(" in rust and "HedgingOptions::new()" in rust
    assert ".set_delay(Duration::from_millis(250))" in rust and ".set_max_tokens(250_u32)" in rust
    assert ".set_refill_ratio(0.001_f32)" in rust
    for client in ("java", "go", "rust"):
        names = CLIENT_SETTINGS[client]
        code = {"java": java, "go": go, "rust": rust}[client]
        assert names.delay in code and names.max_tokens in code and names.refill_ratio in code
        # every client takes the same ranges as hedgepub's HedgingSettings
        assert (names.delay_range_s, names.max_tokens_range, names.refill_ratio_range) == (
            (0.1, 10.0),
            (1, 250),
            (0.001, 0.2),
        )
    # and so the grid refuses what none of them would take
    for bad in ({"delays": (0.05,)}, {"tokens": (251,)}, {"refills": (0.3,)}):
        with pytest.raises(ValueError):
            grid(**bad)


def test_the_recommendation_is_the_lowest_p99_within_the_budget() -> None:
    samples = _go_mix(1500)
    predictions = [replay(samples, c.hedging, name=c.name) for c in grid((0.1, 1.0), (), (50,), (0.01, 0.1))]
    chosen = recommend(predictions, max_extra_rpcs=0.1)
    assert chosen.name == "fixed-100ms/50/0.1"
    assert recommend(predictions, max_extra_rpcs=0.0).name == "unhedged"


def test_the_advise_command_prints_the_frontier_and_code_and_writes_files(
    hedgepub_cli, tmp_path: Path
) -> None:
    csv_path = tmp_path / "latencies.csv"
    samples = _go_mix(800)
    csv_path.write_text(
        "sent_at_s,latency_ms\n"
        + "".join(
            f"{t},{lat * 1000}\n" for t, lat in zip(samples.sent_at_s or (), samples.latencies_s, strict=True)
        )
    )
    out = tmp_path / "advice"
    result = hedgepub_cli(
        "advise", str(csv_path), "--delays", "0.1,0.5", "--percentiles", "95", "--tokens", "10",
        "--refills", "0.01,0.1", "--out", str(out),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    # 10 tokens refilled by 0.01 per publish cannot pay for the 5% slow publishes in the long run
    assert "recommended" in result.output and "fixed-100ms/10/0.1" in result.output
    assert "HedgingSettings(hedge_delay=0.1, max_tokens=10, refill_ratio=0.1)" in result.output
    assert ".setHedgingSettings(hedgingSettings)" in result.output and "set_hedging_options" in result.output
    advice = json.loads((out / "advice.json").read_text())
    assert advice["model"] == "trace" and advice["input"]["publishes"] == 800
    assert advice["settings"]["passes"] == 2  # the steady state: the bucket as a first pass left it
    assert len(advice["predictions"]) == 1 + 2 * 2 + 2
    assert advice["recommended"]["name"] == "fixed-100ms/10/0.1"
    assert (out / "frontier.png").read_bytes().startswith(PNG_SIGNATURE)

    missing = hedgepub_cli("advise", str(tmp_path / "nothing.json"), "--out", str(out))
    assert missing.exit_code == 1 and "cannot read latencies" in missing.output
    bad = hedgepub_cli("advise", str(csv_path), "--delays", "0.01", "--out", str(out))
    assert bad.exit_code == 2 and "hedge_delay" in bad.output


def test_asyncio_is_left_clean() -> None:
    # the replay runs on its own virtual-time loops and leaves no loop set behind
    replay(_go_mix(50), HedgingSettings(hedge_delay=0.1))
    with pytest.raises(RuntimeError):
        asyncio.get_running_loop()
