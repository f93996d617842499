"""``hedgepub advise``: wall time, CPU time and peak RSS per input, each run a fresh process.

Inputs written once to a temporary directory:

- ``bench``: a bench ``results.json`` as ``hedgepub bench`` writes it by default (2,000 measured publishes
  per publisher at 40/s, the Go client's mix: 95% 5 ms, 4% 300 ms, 1% 4 s), advised with the default
  grid of 109 settings (``--messages`` changes the count);
- ``monitoring``: a Cloud Monitoring export of ``topic/send_request_latencies``, 2,000 points of 100
  exponential buckets each (200,000 buckets, about 1.4 MB), advised with the default grid.

Each round runs every input under the code being measured and, with ``--baseline-src``, under an older
hedgepub (its ``src`` directory), interleaved, and reports per input the median [min-max] over the rounds
and the ratio current / baseline, with the load average before and after.

    python benchmarks/advise_speed.py --rounds 3
    python benchmarks/advise_speed.py --rounds 3 --baseline-src /tmp/old/src
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN = "import sys; from hedgepub.cli import main; sys.argv = ['hedgepub', *sys.argv[1:]]; main()"


def write_bench(path: Path, messages: int) -> Path:
    """A bench results.json holding the unhedged publisher's samples (the Go client's mix)."""
    rng = random.Random(3)
    latencies, sent, now = [], [], 0.0
    for _ in range(messages):
        draw = rng.random()
        latencies.append(round((4.0 if draw < 0.01 else 0.3 if draw < 0.05 else 0.005) * 1000, 3))
        sent.append(round(now, 6))
        now += rng.expovariate(40.0)
    document = {"results": [], "samples": {"unhedged": {"sent_at_s": sent, "latency_ms": latencies}}}
    path.write_text(json.dumps(document))
    return path


def write_monitoring(path: Path, points: int, buckets: int) -> Path:
    """A timeSeries export: ``points`` distributions of ``buckets`` exponential buckets (in us)."""
    rng = random.Random(5)
    series_points = []
    exponential = {"numFiniteBuckets": buckets, "growthFactor": 1.1, "scale": 100}
    for _ in range(points):
        counts = [str(rng.randint(0, 50)) for _ in range(buckets + 2)]
        series_points.append(
            {
                "value": {
                    "distributionValue": {
                        "count": str(sum(int(c) for c in counts)),
                        "bucketOptions": {"exponentialBuckets": exponential},
                        "bucketCounts": counts,
                    }
                }
            }
        )
    document = {"timeSeries": [{"unit": "us", "valueType": "DISTRIBUTION", "points": series_points}]}
    path.write_text(json.dumps(document))
    return path


def run_once(src: Path, source: Path, out: Path) -> tuple[float, float, float, int]:
    """One ``hedgepub advise SOURCE`` in a fresh process: wall s, CPU s, peak RSS MiB, exit code."""
    env = {**os.environ, "PYTHONPATH": str(src), "MPLBACKEND": "Agg"}
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-c", RUN, "advise", str(source), "--out", str(out)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.stderr is not None:
        error = process.stderr.read().decode(errors="replace")
        process.stderr.close()
        if process.returncode:
            print(f"  exit {process.returncode}: {error.strip()[-300:]}", flush=True)
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, process.returncode


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):,.2f} [{min(values):,.2f}-{max(values):,.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--messages", type=int, default=2000, help="publishes in the bench results.json")
    parser.add_argument("--points", type=int, default=2000, help="points in the Cloud Monitoring export")
    parser.add_argument("--buckets", type=int, default=100, help="finite buckets per point")
    parser.add_argument("--inputs", default="bench,monitoring", help="which inputs (comma-separated)")
    parser.add_argument("--baseline-src", type=Path, default=None, help="an older hedgepub's src directory")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="advise-speed-") as tmp:
        directory = Path(tmp)
        sources = {
            "bench": lambda: write_bench(directory / "results.json", args.messages),
            "monitoring": lambda: write_monitoring(directory / "export.json", args.points, args.buckets),
        }
        inputs = {name: sources[name]() for name in args.inputs.split(",")}
        trees = {"current": ROOT / "src"}
        if args.baseline_src is not None:
            trees["baseline"] = args.baseline_src.resolve()
        figures: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
        load_before = os.getloadavg()
        for number in range(1, args.rounds + 1):
            for name, source in inputs.items():
                order = list(trees.items()) if number % 2 else list(reversed(trees.items()))
                for tree, src in order:
                    wall, cpu, rss, code = run_once(src, source, directory / f"out-{tree}")
                    figures.setdefault((name, tree), []).append((wall, cpu, rss))
                    print(
                        f"round {number} {name:<10} {tree:<8} wall {wall:7.2f} s  cpu {cpu:7.2f} s  "
                        f"peak RSS {rss:7.1f} MiB  exit {code}  load {os.getloadavg()[0]:.1f}",
                        flush=True,
                    )
        load_after = os.getloadavg()
        print(f"\n{args.rounds} rounds; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
        print(f"{'input':<11} {'tree':<9} {'wall s':<24} {'CPU s':<24} {'peak RSS MiB':<26}")
        for (name, tree), rows in figures.items():
            walls, cpus, rsss = ([row[i] for row in rows] for i in range(3))
            print(f"{name:<11} {tree:<9} {summary(walls):<24} {summary(cpus):<24} {summary(rsss):<26}")
        if "baseline" in trees:
            for name in inputs:
                now, then = figures[(name, "current")], figures[(name, "baseline")]
                ratios = [
                    statistics.median(row[i] for row in now) / statistics.median(row[i] for row in then)
                    for i in range(3)
                ]
                print(
                    f"{name}: current / baseline: wall {ratios[0]:.2f}x, CPU {ratios[1]:.2f}x, "
                    f"peak RSS {ratios[2]:.2f}x"
                )


if __name__ == "__main__":
    main()
