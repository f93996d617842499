"""Publish throughput of the local server: SQLite-backed versus in-memory, side by side in one run.

Several concurrent publishers send Publish RPCs of 100 messages of 100 bytes each (the requests are
serialized once up front, so the client costs little and the server is what is measured). Each store
gets its own ``LocalServer``; rounds alternate between them so that a busy machine hurts both alike.

    python benchmarks/server_ingest.py                      # 100,000 messages per store and round
    python benchmarks/server_ingest.py --messages 20000 --rounds 1 --publishers 8
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import grpc.aio
from google.pubsub_v1.types import pubsub as pubsub_types

from hedgepub.server import LocalServer

TOPIC = "projects/bench/topics/ingest"
PUBLISH = "/google.pubsub.v1.Publisher/Publish"
PublishRequest: Any = pubsub_types.PublishRequest.pb()
PublishResponse: Any = pubsub_types.PublishResponse.pb()
PubsubMessage: Any = pubsub_types.PubsubMessage.pb()
Topic: Any = pubsub_types.Topic.pb()


@dataclass(frozen=True)
class Run:
    """One timed run against one store."""

    store: str
    messages: int
    seconds: float
    rpc_p50_ms: float
    rpc_p99_ms: float

    @property
    def messages_per_second(self) -> float:
        return self.messages / self.seconds


async def _publish_all(address: str, requests: int, publishers: int, request: bytes, batch: int) -> Run:
    async with grpc.aio.insecure_channel(address) as channel:
        await channel.unary_unary(
            "/google.pubsub.v1.Publisher/CreateTopic",
            request_serializer=lambda message: message.SerializeToString(),
        )(Topic(name=TOPIC), timeout=10)
        # Raw bytes in and out: no client-side (de)serialization inside the timed loop.
        publish = channel.unary_unary(PUBLISH)
        # Warm-up (connection, first SQLite transaction) outside the measurement.
        PublishResponse.FromString(await publish(request, timeout=30))

        remaining = requests
        latencies: list[float] = []
        acknowledged = 0

        async def publisher() -> None:
            nonlocal remaining, acknowledged
            while remaining > 0:
                remaining -= 1
                sent = time.perf_counter()
                response = await publish(request, timeout=60)
                latencies.append(time.perf_counter() - sent)
                acknowledged += len(PublishResponse.FromString(response).message_ids)

        started = time.perf_counter()
        await asyncio.gather(*(publisher() for _ in range(publishers)))
        seconds = time.perf_counter() - started
    if acknowledged != requests * batch:
        raise RuntimeError(f"the server acknowledged {acknowledged} messages, expected {requests * batch}")
    latencies.sort()
    return Run(
        store="",
        messages=acknowledged,
        seconds=seconds,
        rpc_p50_ms=latencies[len(latencies) // 2] * 1e3,
        rpc_p99_ms=latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e3,
    )


def measure(store: str, messages: int, publishers: int, batch: int, size: int) -> Run:
    """Start a fresh server with ``store`` ("sqlite" or "memory"), publish ``messages``, stop it."""
    request = PublishRequest(topic=TOPIC, messages=[PubsubMessage(data=b"x" * size) for _ in range(batch)])
    requests = max(1, messages // batch)
    # With no data_dir LocalServer keeps SQLite in a temporary directory, removed when it stops.
    with LocalServer(in_memory=store == "memory") as server:
        run = asyncio.run(
            _publish_all(server.address, requests, publishers, request.SerializeToString(), batch)
        )
    return Run(store, run.messages, run.seconds, run.rpc_p50_ms, run.rpc_p99_ms)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print a table and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=100_000, help="messages per store and round")
    parser.add_argument("--publishers", type=int, default=4, help="concurrent publishers")
    parser.add_argument("--batch", type=int, default=100, help="messages per Publish RPC")
    parser.add_argument("--size", type=int, default=100, help="bytes per message")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each runs both stores")
    args = parser.parse_args(argv)

    runs: list[Run] = []
    for round_number in range(args.rounds):
        # Alternate which store goes first, so that neither always gets the warmer machine.
        order = ("sqlite", "memory") if round_number % 2 == 0 else ("memory", "sqlite")
        for store in order:
            run = measure(store, args.messages, args.publishers, args.batch, args.size)
            runs.append(run)
            print(
                f"round {round_number + 1} {store:>6}: {run.messages:,} messages in {run.seconds:.2f} s "
                f"= {run.messages_per_second:,.0f} msg/s",
                file=sys.stderr,
            )

    print()
    print(
        f"server ingest: {args.messages:,} messages of {args.size} B per round, {args.batch} per Publish, "
        f"{args.publishers} publishers, {args.rounds} round(s); {platform.python_implementation()} "
        f"{platform.python_version()}, {platform.machine()}"
    )
    header = f"{'store':<8} {'msg/s (median)':>15} {'MB/s':>7} {'RPC p50 ms':>11} {'RPC p99 ms':>11}"
    print(header)
    print("-" * len(header))
    medians: dict[str, float] = {}
    for store in ("sqlite", "memory"):
        mine = [run for run in runs if run.store == store]
        rate = statistics.median(run.messages_per_second for run in mine)
        medians[store] = rate
        p50 = statistics.median(run.rpc_p50_ms for run in mine)
        p99 = statistics.median(run.rpc_p99_ms for run in mine)
        print(f"{store:<8} {rate:>15,.0f} {rate * args.size / 1e6:>7.2f} {p50:>11.1f} {p99:>11.1f}")
    print(f"ratio sqlite / memory: {medians['sqlite'] / medians['memory']:.2f}")


if __name__ == "__main__":
    main()
