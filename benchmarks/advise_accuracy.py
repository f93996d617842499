"""How close ``hedgepub advise``'s predictions come to hedged publishers measured live.

Each round runs ``hedgepub bench``'s experiment (in process, its own local server) for one scenario, then
replays the unhedged publisher's latencies alone (send times and latencies of its publishes, what
``results.json`` holds under ``samples``) through the hedging engine with each hedged publisher's
settings, exactly as ``hedgepub advise`` does, and compares the predicted p99 and extra RPCs per publish
with what that hedged publisher measured in the same run. The replay starts as the bench's hedged
publishers did: with the tokens their buckets held (``config.run.tokens_at_start``: full after the
warm-up) and, for the adaptive delay, an estimator holding as many latencies as the warm-up published,
at the delay they had given (``config.run.hedge_delay_at_start_ms``); it plays the schedule once (as
``hedgepub advise --passes 1``; the advice's default of two passes predicts the steady state instead,
where only the refill ratio pays for hedges). The scenarios alternate round by round (interleaved), so a
busy spell of the machine does not fall on one scenario only.

Publishers compared: the default mix's ``fixed-100ms`` and ``adaptive``; correlated-stalls' ``hedged``
(hedges to the stalling primary; ``cross_endpoint`` hedges to another server, whose latency the
unhedged run never saw). Printed per round, then per publisher the median with [min-max] of
predicted / measured, and the load average (the machine is shared: the bench's own latency includes
it, for the unhedged and hedged publishers alike).

    python benchmarks/advise_accuracy.py --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics

from hedgepub.bench import BenchConfig, LatencySamples, replay, run_bench

SCENARIOS = ("latency-mix", "correlated-stalls")


def _compare(scenario: str, seed: int, messages: int | None) -> list[tuple[str, float, float, float, float]]:
    """(publisher, predicted p99, measured p99, predicted extra RPCs, measured extra RPCs) of one run."""
    if scenario == "correlated-stalls":
        config = BenchConfig(
            scenario="correlated-stalls", hedge_delays=(0.1,), messages=messages or 1_800, seed=seed
        )
    else:
        config = BenchConfig(seed=seed, messages=messages or BenchConfig().messages)
    run = asyncio.run(run_bench(config))
    unhedged = run.document["samples"]["unhedged"]
    samples = LatencySamples(
        tuple(ms / 1000 for ms in unhedged["latency_ms"]), tuple(unhedged["sent_at_s"]), "unhedged"
    )
    rows = []
    for spec in config.publishers():
        if spec.hedging is None or spec.cross_endpoint:
            continue
        # as the bench ran: the bucket as its warm-up left it (full, unless the machine made the warm-up's
        # own publishes slow enough to hedge), one pass of the schedule
        started = run.document["config"]["run"]
        tokens = started["tokens_at_start"][spec.name]
        # an adaptive delay's estimator held the warm-up's latencies: as many at the delay they gave
        delay = (
            started["hedge_delay_at_start_ms"][spec.name] / 1000,
            run.document["config"]["warmup_publishes"],
        )
        predicted = replay(samples, spec.hedging, passes=1, initial_tokens=tokens, initial_delay=delay)
        measured = run.document["results"][spec.name]
        rows.append(
            (
                f"{scenario}/{spec.name}",
                predicted.p99_ms,
                measured["p99_ms"],
                predicted.extra_rpcs,
                measured["attempts_per_publish"] - 1,
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds per scenario (default 3)")
    parser.add_argument(
        "--messages",
        type=int,
        default=None,
        help="measured publishes per publisher (default: the scenario's, 2,000 and 1,800); more publishes "
        "make each run's p99 steadier",
    )
    arguments = parser.parse_args()
    ratios: dict[str, list[tuple[float, float]]] = {}
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    for round_number in range(arguments.rounds):
        for scenario in SCENARIOS:
            compared = _compare(scenario, round_number + 1, arguments.messages)
            for name, p99, live_p99, extra, live_extra in compared:
                print(
                    f"round {round_number + 1} {name:32} p99 predicted {p99:8.1f} ms measured "
                    f"{live_p99:8.1f} ms; extra RPCs predicted {extra * 100:5.1f}% measured "
                    f"{live_extra * 100:5.1f}%  (load {os.getloadavg()[0]:.2f})",
                    flush=True,
                )
                ratios.setdefault(name, []).append(
                    (p99 / live_p99, extra / live_extra if live_extra else float("nan"))
                )
    print("\npredicted / measured: median [min-max] over rounds")
    for name, values in ratios.items():
        p99s = [p for p, _ in values]
        extras = [e for _, e in values]
        print(
            f"{name:32} p99 {statistics.median(p99s):.2f} [{min(p99s):.2f}-{max(p99s):.2f}]   "
            f"extra RPCs {statistics.median(extras):.2f} [{min(extras):.2f}-{max(extras):.2f}]"
        )
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
