"""Publish memory: peak memory of hedgepub's sync client (hedging off and on) against the official publisher.

Each client runs alone in a fresh child process (so that no client inherits another's heap) and publishes
the same N messages of 100 bytes with default batch settings to one local server (in memory, in its own
child process), keeping every future until all are published, as ``publish_throughput.py`` does. What is
reported per client is its peak RSS increase: ``ru_maxrss`` once the client is built and has published a
1,000-message warm-up (imports, channel, threads), subtracted from ``ru_maxrss`` after the N messages.
``--tracemalloc`` adds a second run per client that reports the peak of Python allocations instead (it
misses memory that C code allocates, such as protobuf messages, and slows publishing down). The server,
topics, payload and hedge delay are those of ``publish_throughput.py``.

    python benchmarks/publish_memory.py [--messages 100000] [--rounds 1] [--tracemalloc]
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from publish_throughput import HEDGE_DELAY, PAYLOAD, create_topic, local_server

WARM_UP = 1_000
CLIENTS = ("off", "on", "official")
LABELS = {
    "off": "hedgepub sync, hedging off",
    "on": "hedgepub sync, hedging on",
    "official": "google-cloud-pubsub",
}


def _max_rss_bytes() -> int:
    # ru_maxrss is in kilobytes on Linux, in bytes on macOS.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _client(name: str) -> tuple[Callable[..., Any], Callable[[], None]]:
    """The ``publish`` function and the ``close`` of a new client called ``name``."""
    if name == "official":
        from google.cloud import pubsub_v1

        official = pubsub_v1.PublisherClient()
        return official.publish, official.stop
    from hedgepub import HedgingSettings, PublisherClient

    publisher = PublisherClient(
        hedging_settings=HedgingSettings(hedge_delay=HEDGE_DELAY) if name == "on" else None
    )
    return publisher.publish, publisher.shutdown


def _publish_all(publish: Callable[..., Any], topic: str, messages: int) -> None:
    futures = [publish(topic, PAYLOAD) for _ in range(messages)]
    published = sum(1 for future in futures if future.result())
    if published != messages:
        raise RuntimeError(f"published {published} of {messages} messages")


def measure(name: str, warm_up_topic: str, topic: str, messages: int, trace: bool) -> dict[str, float]:
    """In a child process: build client ``name``, warm it up, publish ``messages``; report memory and time."""
    publish, close = _client(name)
    try:
        _publish_all(publish, warm_up_topic, WARM_UP)
        if trace:
            tracemalloc.start()
        before = _max_rss_bytes()
        started = time.perf_counter()
        _publish_all(publish, topic, messages)
        elapsed = time.perf_counter() - started
        after = _max_rss_bytes()
        traced_peak = tracemalloc.get_traced_memory()[1] if trace else 0
    finally:
        close()
    return {
        "rss_before": before,
        "rss_increase": after - before,
        "traced_peak": traced_peak,
        "seconds": elapsed,
    }


def _run_in_child(context: Any, *args: Any) -> dict[str, float]:
    with context.Pool(1, maxtasksperchild=1) as pool:
        return pool.apply(measure, args)  # type: ignore[no-any-return]


def _mib(value: float) -> str:
    return f"{value / 2**20:>8,.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print each client's peak memory increase and the ratios."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=100_000, help="messages per client per round")
    parser.add_argument("--rounds", type=int, default=1, help="rounds (each runs all three clients)")
    parser.add_argument("--tracemalloc", action="store_true", help="also measure Python allocations")
    options = parser.parse_args(argv)

    context = multiprocessing.get_context("spawn")
    rss: dict[str, list[float]] = {name: [] for name in CLIENTS}
    traced: dict[str, list[float]] = {name: [] for name in CLIENTS}
    with local_server() as address:
        for round_number in range(options.rounds):
            order = list(CLIENTS[round_number % 3 :] + CLIENTS[: round_number % 3])
            for name in order:
                warm_up = create_topic(address, f"memory-{round_number}-{name}-warm-up")
                topic = create_topic(address, f"memory-{round_number}-{name}")
                result = _run_in_child(context, name, warm_up, topic, options.messages, False)
                rss[name].append(result["rss_increase"])
                increase, base = _mib(result["rss_increase"]).strip(), _mib(result["rss_before"]).strip()
                rate = options.messages / result["seconds"]
                print(
                    f"round {round_number + 1} {name:>8}: peak RSS +{increase} (from {base}), "
                    f"{rate:,.0f} messages/s",
                    flush=True,
                )
                if options.tracemalloc:
                    topic = create_topic(address, f"memory-{round_number}-{name}-traced")
                    result = _run_in_child(context, name, warm_up, topic, options.messages, True)
                    traced[name].append(result["traced_peak"])
                    peak = _mib(result["traced_peak"]).strip()
                    print(f"round {round_number + 1} {name:>8}: tracemalloc peak {peak}", flush=True)

    print()
    print(
        f"{options.messages:,} messages of {len(PAYLOAD)} bytes, default batch settings, every future kept, "
        f"each client in its own process, {options.rounds} round(s) (medians)"
    )
    medians = {name: statistics.median(rss[name]) for name in CLIENTS}
    for name in CLIENTS:
        line = f"{LABELS[name]:<28}: peak RSS +{_mib(medians[name])}"
        if options.tracemalloc:
            line += f"   tracemalloc peak {_mib(statistics.median(traced[name]))}"
        print(line)
    print(f"hedgepub (off) / official   : {medians['off'] / medians['official']:>6.2f}x peak RSS increase")
    print(f"hedgepub (on) / official    : {medians['on'] / medians['official']:>6.2f}x peak RSS increase")
    if options.tracemalloc:
        ratio = statistics.median(traced["off"]) / statistics.median(traced["official"])
        print(f"hedgepub (off) / official   : {ratio:>6.2f}x tracemalloc peak")
    return 0


if __name__ == "__main__":
    sys.exit(main())
