"""Concurrency like the emulator's: thousands of REST connections and gRPC calls at once, hedgepub beside
Google's emulator.

Two loads, each against every target in turn (the order alternating between rounds, so that a busy
machine hurts all alike):

* ``rest``: ``--connections`` (2,000) HTTP/1.1 connections opened at once, each sending ``--per-connection``
  (5) Publish requests of one small message, one after the other on its kept-alive connection;
* ``grpc``: ``--calls`` (5,000) unary Publish calls started at once on one gRPC channel.

For each it prints how many calls failed (by HTTP status or gRPC code), how many messages the server
acknowledged, the latency of the calls (p50, p99, max) and the wall time of the whole load; then medians
with [min-max] over the rounds, and the load average before and after.

Targets: ``sqlite`` and ``memory`` (``hedgepub serve``, a fresh process each round), ``sqlite-grpc``
(``--no-rest``; the gRPC load only), and ``emulator`` (Google's Pub/Sub emulator, one JVM for the whole
run, warmed before the first round with ``--warm-messages`` messages and both loads once at a tenth of
their size). Each round uses a new topic.

    python benchmarks/server_load.py                          # 3 rounds, both loads, every target
    python benchmarks/server_load.py --rounds 1 --connections 500 --calls 1000 --targets memory
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import resource
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import grpc.aio
from google.pubsub_v1.types import pubsub

from server_ingest import HOST, ServerProcess, build_request, emulator_binary, load_average, spread

PUBLISH = "/google.pubsub.v1.Publisher/Publish"
CREATE_TOPIC = "/google.pubsub.v1.Publisher/CreateTopic"


@dataclass
class Load:
    """What one load did against one target."""

    target: str
    kind: str
    calls: int = 0
    acknowledged: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    seconds: float = 0.0

    def percentile(self, fraction: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))] * 1e3 if ordered else 0.0

    def line(self) -> str:
        failed = sum(self.failures.values())
        detail = ", ".join(f"{name} {count}" for name, count in self.failures.most_common()) or "none"
        return (
            f"  {self.target:<12} {self.kind:<5} {self.calls:>6,} calls  {failed:>6,} failed ({detail})  "
            f"acked {self.acknowledged:,}  p50 {self.percentile(0.5):,.0f} ms  "
            f"p99 {self.percentile(0.99):,.0f} ms"
            f"  max {max(self.latencies, default=0) * 1e3:,.0f} ms  wall {self.seconds:.1f} s"
        )


async def create_topic(address: str, topic: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        topic_class = pubsub.Topic.pb()
        await channel.unary_unary(CREATE_TOPIC, request_serializer=topic_class.SerializeToString)(
            topic_class(name=topic), timeout=60, wait_for_ready=True
        )


async def _rest_connection(port: int, topic: str, requests: int, load: Load, start: asyncio.Event) -> None:
    body = json.dumps({"messages": [{"data": base64.b64encode(b"x" * 100).decode()}]}).encode()
    head = (
        f"POST /v1/{topic}:publish HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    await start.wait()
    try:
        reader, writer = await asyncio.open_connection(HOST, port)
    except OSError as error:
        load.failures[f"connect {type(error).__name__}"] += requests
        load.calls += requests
        return
    try:
        for _ in range(requests):
            load.calls += 1
            sent = time.perf_counter()
            try:
                writer.write(head + body)
                status_line = await reader.readline()
                length = 0
                while (line := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = line.decode("latin-1").partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                answer = await reader.readexactly(length)
            except (OSError, asyncio.IncompleteReadError) as error:
                load.failures[type(error).__name__] += 1
                return
            load.latencies.append(time.perf_counter() - sent)
            parts = status_line.split()
            status = parts[1].decode() if len(parts) > 1 else "no answer"
            if status == "200":
                load.acknowledged += len(json.loads(answer).get("messageIds", []))
            else:
                load.failures[f"HTTP {status}"] += 1
    finally:
        writer.close()


async def rest_load(target: str, port: int, topic: str, connections: int, per_connection: int) -> Load:
    load = Load(target, "rest")
    start = asyncio.Event()
    tasks = [
        asyncio.ensure_future(_rest_connection(port, topic, per_connection, load, start))
        for _ in range(connections)
    ]
    await asyncio.sleep(0)
    started = time.perf_counter()
    start.set()
    await asyncio.gather(*tasks)
    load.seconds = time.perf_counter() - started
    return load


async def grpc_load(target: str, address: str, topic: str, calls: int) -> Load:
    load = Load(target, "grpc")
    request = build_request(topic, 1, 100)
    async with grpc.aio.insecure_channel(address) as channel:
        publish = channel.unary_unary(PUBLISH)
        await publish(request, timeout=60, wait_for_ready=True)  # the connection, outside the measurement

        async def one() -> None:
            sent = time.perf_counter()
            load.calls += 1
            try:
                await publish(request, timeout=120)
            except grpc.aio.AioRpcError as error:
                load.failures[error.code().name] += 1
            else:
                load.acknowledged += 1
            load.latencies.append(time.perf_counter() - sent)

        started = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(calls)))
        load.seconds = time.perf_counter() - started
    return load


TARGETS = {"sqlite": ("sqlite", True), "memory": ("memory", True), "sqlite-grpc": ("sqlite", False)}


async def run_round(
    target: str, args: argparse.Namespace, emulator: ServerProcess | None, round_number: int
) -> list[Load]:
    server = emulator
    scratch = None
    if target != "emulator":
        kind, rest = TARGETS[target]
        scratch = tempfile.TemporaryDirectory(prefix="hedgepub-load-")
        server = ServerProcess(kind, data_dir=Path(scratch.name) / "data", rest=rest)
        server.start()
    assert server is not None
    loads = []
    try:
        topic = f"projects/load/topics/round-{round_number}-{target}"
        await create_topic(server.address, topic)
        if "rest" in args.loads and (target != "sqlite-grpc"):
            loads.append(await rest_load(target, server.port, topic, args.connections, args.per_connection))
        if "grpc" in args.loads:
            loads.append(await grpc_load(target, server.address, topic, args.calls))
    finally:
        if server is not emulator:
            server.stop()
        if scratch is not None:
            scratch.cleanup()
    return loads


async def warm_emulator(emulator: ServerProcess, args: argparse.Namespace) -> None:
    topic = "projects/load/topics/warm"
    await create_topic(emulator.address, topic)
    request = build_request(topic, 100, 100)
    async with grpc.aio.insecure_channel(emulator.address) as channel:
        publish = channel.unary_unary(PUBLISH)
        for _ in range(max(1, args.warm_messages // 100 // 4)):
            await asyncio.gather(*(publish(request, timeout=60) for _ in range(4)))
    await rest_load("emulator", emulator.port, topic, max(1, args.connections // 10), args.per_connection)
    await grpc_load("emulator", emulator.address, topic, max(1, args.calls // 10))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--targets", default="sqlite,sqlite-grpc,emulator")
    parser.add_argument("--loads", default="rest,grpc")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("--per-connection", type=int, default=5)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--warm-messages", type=int, default=100_000)
    args = parser.parse_args(argv)
    # Thousands of connections need as many descriptors in this process (and the servers inherit it).
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    targets = [name.strip() for name in args.targets.split(",") if name.strip()]
    if "emulator" in targets and emulator_binary() is None:
        print("Google's Pub/Sub emulator is not installed: skipped", file=sys.stderr)
        targets.remove("emulator")
    print(f"load average before: {load_average()}  (cores: {os.cpu_count()}, descriptors: {hard})")
    emulator = None
    results: dict[tuple[str, str], list[Load]] = {}
    try:
        if "emulator" in targets:
            emulator = ServerProcess("emulator")
            emulator.start()
            print(
                f"warming the emulator: {args.warm_messages:,} messages, then both loads at a tenth",
                flush=True,
            )
            asyncio.run(warm_emulator(emulator, args))
        for round_number in range(args.rounds):
            order = targets if round_number % 2 == 0 else targets[::-1]
            print(f"round {round_number + 1}:", flush=True)
            for target in order:
                for load in asyncio.run(run_round(target, args, emulator, round_number)):
                    print(load.line(), flush=True)
                    results.setdefault((load.target, load.kind), []).append(load)
    finally:
        if emulator is not None:
            emulator.stop()
    print("summary (median [min-max] over rounds):")
    for (target, kind), loads in results.items():
        failed = [float(sum(load.failures.values())) for load in loads]
        p50 = [load.percentile(0.5) for load in loads]
        p99 = [load.percentile(0.99) for load in loads]
        wall = [load.seconds for load in loads]
        print(
            f"  {target:<12} {kind:<5} failed {spread(failed)} of {loads[0].calls:,}  p50 {spread(p50)} ms  "
            f"p99 {spread(p99)} ms  wall {spread(wall, '.1f')} s"
        )
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
