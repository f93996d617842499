"""The tail-latency experiment behind ``hedgepub bench``, and its report, plot and JSON output.

::

    config = BenchConfig(messages=500, rate=100)
    run = asyncio.run(run_bench(config))
    print_report(run.document)
    plot_latency_cdf(run.latencies_ms, "tail-latency.png", results=run.document["results"])
    write_results_json(run.document, "results.json")
"""

# First: without the `bench` extra, say which extra to install rather than which module is missing
# (so the imports below come after a statement).
# ruff: noqa: E402
from hedgepub._extras import require

require("bench", "hedgepub.bench (the bench)")

# isort: split
from hedgepub.admin import EMULATOR_HOST_VARIABLE, AdminClient, default_project, resource_path
from hedgepub.bench._advise import Advice, Candidate, Prediction, advise, grid, replay
from hedgepub.bench._config import (
    DEFAULT_MIX,
    DEFAULT_STALL,
    HARNESSES,
    NETWORK_SCENARIOS,
    SCENARIOS,
    BenchConfig,
    PublisherSpec,
)
from hedgepub.bench._experiment import (
    BenchInterrupted,
    BenchProgress,
    BenchRun,
    RemoteTarget,
    run_bench,
    run_remote_bench,
)
from hedgepub.bench._latencies import LatencySamples, load_latencies
from hedgepub.bench._plot import LABEL_GID, latency_cdf_figure, plot_frontier, plot_latency_cdf
from hedgepub.bench._report import (
    RESULT_KEYS,
    LatencyRecorder,
    PublisherResult,
    build_table,
    print_report,
    render_markdown,
    results_document,
    write_results_json,
)
from hedgepub.bench._schedule import arrival_times, pair_orders

__all__ = [
    "DEFAULT_MIX",
    "DEFAULT_STALL",
    "EMULATOR_HOST_VARIABLE",
    "HARNESSES",
    "LABEL_GID",
    "NETWORK_SCENARIOS",
    "RESULT_KEYS",
    "SCENARIOS",
    "AdminClient",
    "Advice",
    "BenchConfig",
    "BenchInterrupted",
    "BenchProgress",
    "BenchRun",
    "Candidate",
    "LatencyRecorder",
    "LatencySamples",
    "Prediction",
    "PublisherResult",
    "PublisherSpec",
    "RemoteTarget",
    "advise",
    "arrival_times",
    "build_table",
    "default_project",
    "grid",
    "latency_cdf_figure",
    "load_latencies",
    "pair_orders",
    "plot_frontier",
    "plot_latency_cdf",
    "print_report",
    "render_markdown",
    "replay",
    "resource_path",
    "results_document",
    "run_bench",
    "run_remote_bench",
    "write_results_json",
]
