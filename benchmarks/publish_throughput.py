"""Publish throughput: hedgepub's sync client (hedging off and on) against the official publisher.

Every client publishes N messages of 100 bytes with default batch settings to the same local server (in
memory, started here in a child process so that it has its own interpreter and does not share the GIL
with the client being measured). The three clients run in turn, round after round, so that they share
the machine's noise; the figure reported for each is its median over the rounds.

    python benchmarks/publish_throughput.py [--messages 100000] [--rounds 3]

Targets: hedgepub >= 4x the official client; hedging on (not triggered) >= 0.95x hedging off.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

PROJECT = "bench-project"
PAYLOAD = b"x" * 100
HEDGE_DELAY = 1.0  # seconds; a healthy local server answers far sooner, so no hedge is sent


def _serve(
    address_pipe: multiprocessing.connection.Connection,
    stop: multiprocessing.synchronize.Event,
    options: dict[str, Any],
) -> None:
    from hedgepub.server import LocalServer

    with LocalServer(in_memory=True, **options) as server:
        address_pipe.send(server.address)
        stop.wait()


@contextlib.contextmanager
def local_server(context: multiprocessing.context.SpawnContext, **options: Any) -> Iterator[str]:
    """An in-memory local server in a child process; yields its address, also set in PUBSUB_EMULATOR_HOST.

    ``options`` go to its ``LocalServer`` (``rest=False``, ...).
    """
    receive, send = context.Pipe(duplex=False)
    stop = context.Event()
    server = context.Process(target=_serve, args=(send, stop, options), daemon=True)
    server.start()
    try:
        address = receive.recv()
        os.environ["PUBSUB_EMULATOR_HOST"] = address  # official clients and child processes read it
        yield address
    finally:
        stop.set()
        server.join(10)


def create_topic(address: str, name: str) -> str:
    """Create topic ``name`` of the bench project on the server at ``address``; return its path."""
    from hedgepub.bench import AdminClient

    topic = f"projects/{PROJECT}/topics/{name}"
    with AdminClient(address) as admin:
        admin.create_topic(topic)
    return topic


def _measure(publish_all: Callable[[], int], messages: int) -> float:
    started = time.perf_counter()
    published = publish_all()
    elapsed = time.perf_counter() - started
    if published != messages:
        raise RuntimeError(f"published {published} of {messages} messages")
    return messages / elapsed


def run_hedgepub(topic: str, messages: int, hedging: bool) -> tuple[float, int]:
    """Messages/s of hedgepub's sync client, and the number of hedges it sent."""
    from hedgepub import HedgingSettings, PublisherClient

    settings = HedgingSettings(hedge_delay=HEDGE_DELAY) if hedging else None
    publisher = PublisherClient(hedging_settings=settings)

    def publish_all() -> int:
        publish = publisher.publish
        futures = [publish(topic, PAYLOAD) for _ in range(messages)]
        return sum(1 for future in futures if future.result())

    try:
        rate = _measure(publish_all, messages)
    finally:
        publisher.shutdown()
    return rate, publisher.stats().hedges_sent


def run_official(topic: str, messages: int) -> float:
    """Messages/s of google-cloud-pubsub's PublisherClient (found through PUBSUB_EMULATOR_HOST)."""
    from google.cloud import pubsub_v1

    publisher = pubsub_v1.PublisherClient()

    def publish_all() -> int:
        publish = publisher.publish
        futures = [publish(topic, PAYLOAD) for _ in range(messages)]
        return sum(1 for future in futures if future.result())

    try:
        return _measure(publish_all, messages)
    finally:
        publisher.stop()


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print messages/s and ratios; exit status 1 when a target is missed."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=100_000, help="messages per client per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (each runs all three clients)")
    options = parser.parse_args(argv)

    results: dict[str, list[float]] = {"off": [], "on": [], "official": []}
    hedges = 0
    with local_server(multiprocessing.get_context("spawn")) as address:
        # Warm-up: imports, channels, server code paths.
        run_hedgepub(create_topic(address, "warm-up-hedgepub"), 2_000, hedging=False)
        run_official(create_topic(address, "warm-up-official"), 2_000)
        for round_number in range(options.rounds):
            order = ["off", "on", "official"]
            order = order[round_number % 3 :] + order[: round_number % 3]  # rotate who goes first
            for name in order:
                topic = create_topic(address, f"round-{round_number}-{name}")
                if name == "official":
                    rate = run_official(topic, options.messages)
                else:
                    rate, sent = run_hedgepub(topic, options.messages, hedging=name == "on")
                    hedges += sent
                results[name].append(rate)
                print(f"round {round_number + 1} {name:>8}: {rate:>10,.0f} messages/s", flush=True)

    off, on, official = (statistics.median(results[name]) for name in ("off", "on", "official"))
    speedup, hedging_ratio = off / official, on / off
    print()
    print(
        f"{options.messages:,} messages of {len(PAYLOAD)} bytes, default batch settings, "
        f"{options.rounds} rounds (medians)"
    )
    print(f"hedgepub sync, hedging off : {off:>10,.0f} messages/s")
    print(f"hedgepub sync, hedging on  : {on:>10,.0f} messages/s  (hedges sent: {hedges})")
    print(f"google-cloud-pubsub        : {official:>10,.0f} messages/s")
    print(
        f"hedgepub / official        : {speedup:>6.2f}x  (target >= 4x)  {'ok' if speedup >= 4 else 'MISSED'}"
    )
    print(
        f"hedging on / off           : {hedging_ratio:>6.2f}x  (target >= 0.95x)  "
        f"{'ok' if hedging_ratio >= 0.95 else 'MISSED'}"
    )
    return 0 if speedup >= 4 and hedging_ratio >= 0.95 else 1


if __name__ == "__main__":
    sys.exit(main())
