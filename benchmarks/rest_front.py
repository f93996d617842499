"""Cost of the one-port front: gRPC publish throughput with REST on the same port, against gRPC alone.

With REST on (the default) the server's public port belongs to a front that relays gRPC connections to
the gRPC face listening privately: on Linux by its relay process ("front", kept to one CPU; measured
free to move too, ``HEDGEPUB_RELAY_CPU=any``: "front-free"), elsewhere on the server's event loop,
measured here with ``HEDGEPUB_RELAY=loop`` ("front-loop"); with ``--no-rest`` gRPC listens
on the public port itself ("grpc-alone"). Each
round starts one in-memory ``hedgepub serve`` of each kind as its own process (``server_ingest.py``'s
``ServerProcess``) and publishes the same messages to a topic with one subscription through
``server_ingest.py``'s concurrent raw-bytes publishers, which make the server, not the client, the
bottleneck, so any cost of the relay shows. Rounds rotate which kind goes first.

Two figures per kind: messages/s (wall clock) and the server's CPU time per message (user + system, all
threads, its relay process included, read from /proc on Linux). On a shared machine the first is at the
mercy of the neighbours; the second is what the relay costs the server whatever the load, and a server
that is the bottleneck publishes at 1 / (CPU per message).

    python benchmarks/rest_front.py [--messages 300000] [--rounds 6] [--publishers 4]

Target: front on >= 0.90x gRPC alone (issue 11).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from dataclasses import dataclass

from server_ingest import (
    SUBSCRIPTION,
    TOPIC,
    ServerProcess,
    build_request,
    cpu_seconds,
    create_topic_and_subscriptions,
    publish_requests,
)

TARGET = 0.90
#: Each kind: whether REST is on, and the server's extra environment.
KINDS: dict[str, tuple[bool, dict[str, str]]] = {
    "grpc-alone": (False, {}),
    "front": (True, {}),
    "front-free": (True, {"HEDGEPUB_RELAY_CPU": "any"}),
    "front-loop": (True, {"HEDGEPUB_RELAY": "loop"}),
}


@dataclass(frozen=True)
class Sample:
    """One timed run against one server."""

    messages_per_second: float
    rpc_p50_ms: float
    #: Server CPU time (user + system) per message in microseconds; None where /proc is missing.
    cpu_us_per_message: float | None


def measure(kind: str, messages: int, publishers: int, batch: int, size: int) -> Sample:
    """Publish ``messages`` to a fresh in-memory server of ``kind`` (a key of :data:`KINDS`)."""
    rest, environment = KINDS[kind]
    server = ServerProcess("memory", environment=environment, rest=rest)
    server.start()
    try:
        assert server.process is not None
        asyncio.run(create_topic_and_subscriptions(server.address, TOPIC, [SUBSCRIPTION]))
        requests = max(1, messages // batch)
        before = cpu_seconds(server.process.pid)
        run = asyncio.run(
            publish_requests(server.address, requests, publishers, build_request(TOPIC, batch, size))
        )
        after = cpu_seconds(server.process.pid)
    finally:
        server.stop()
    if run.messages != requests * batch:
        raise RuntimeError(f"{run.messages} messages acknowledged, expected {requests * batch}")
    cpu = None if before is None or after is None else (after - before) / run.messages * 1e6
    return Sample(run.messages_per_second, run.rpc_p50_ms, cpu)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the figures and the ratios; exit status 1 when the target is missed."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=300_000, help="messages per server and round")
    parser.add_argument("--publishers", type=int, default=4, help="concurrent publishers")
    parser.add_argument("--batch", type=int, default=100, help="messages per Publish RPC")
    parser.add_argument("--size", type=int, default=100, help="bytes per message")
    parser.add_argument("--rounds", type=int, default=6, help="rounds; each runs every kind")
    options = parser.parse_args(argv)

    samples: dict[str, list[Sample]] = {kind: [] for kind in KINDS}
    kinds = list(KINDS)
    for round_number in range(options.rounds):
        shift = round_number % len(kinds)
        for kind in kinds[shift:] + kinds[:shift]:
            sample = measure(kind, options.messages, options.publishers, options.batch, options.size)
            samples[kind].append(sample)
            cpu = (
                ""
                if sample.cpu_us_per_message is None
                else f", server CPU {sample.cpu_us_per_message:.1f} us/msg"
            )
            print(
                f"round {round_number + 1} {kind:>10}: {sample.messages_per_second:>10,.0f} msg/s, "
                f"RPC p50 {sample.rpc_p50_ms:.1f} ms{cpu}",
                flush=True,
            )

    rate = {kind: statistics.median(s.messages_per_second for s in samples[kind]) for kind in KINDS}
    p50 = {kind: statistics.median(s.rpc_p50_ms for s in samples[kind]) for kind in KINDS}
    have_cpu = all(s.cpu_us_per_message is not None for kind in KINDS for s in samples[kind])
    cpu = {kind: statistics.median(s.cpu_us_per_message or 0.0 for s in samples[kind]) for kind in KINDS}
    print()
    print(
        f"{options.messages:,} messages of {options.size} B per round, {options.batch} per Publish, "
        f"{options.publishers} publishers, {options.rounds} rounds (medians)"
    )
    for kind in KINDS:
        # Throughput of a CPU-bound server is 1 / CPU per message: alone's CPU over this kind's.
        ratios = (
            ""
            if kind == "grpc-alone"
            else f"  {rate[kind] / rate['grpc-alone']:.2f}x msg/s"
            + (f", {cpu['grpc-alone'] / cpu[kind]:.2f}x by CPU" if have_cpu else "")
        )
        cpu_text = f", server CPU {cpu[kind]:.1f} us/msg" if have_cpu else ""
        print(f"{kind:>10}: {rate[kind]:>10,.0f} msg/s, RPC p50 {p50[kind]:.2f} ms{cpu_text}{ratios}")
    rate_ratio = rate["front"] / rate["grpc-alone"]
    ok = rate_ratio >= TARGET
    print(
        f"front / alone: {rate_ratio:.2f}x messages/s (target >= {TARGET:.2f}x)  {'ok' if ok else 'MISSED'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
