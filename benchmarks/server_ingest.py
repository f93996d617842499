"""Publish throughput: the local server (SQLite, memory), Google's emulator, an older hedgepub, side by side.

Each target runs as its own process (``hedgepub serve``, or Google's Pub/Sub emulator when it is
installed), so the benchmark's client never shares the server's interpreter. Four concurrent raw-gRPC
publishers send Publish RPCs of 100 messages of 100 bytes (serialized once up front, so the client costs
little and the server is what is measured) to a topic with one subscription, so that every message is
stored. Rounds alternate the order of the targets, so a busy machine hurts all alike.

    python benchmarks/server_ingest.py                      # 100,000 messages per target and round
    python benchmarks/server_ingest.py --messages 20000 --rounds 1 --publishers 8
    # An older hedgepub beside this one: its source tree's src/ directory, e.g. from
    #   git worktree add /tmp/old <commit>   (then --baseline-src /tmp/old/src)
    python benchmarks/server_ingest.py --baseline-src /tmp/old/src

The emulator is looked up as ``cloud-pubsub-emulator`` under the Google Cloud SDK that ``gcloud`` on PATH
belongs to (or ``$PUBSUB_EMULATOR_BIN``); it is skipped, with a note, when absent.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc.aio
from google.pubsub_v1.types import pubsub as pubsub_types

TOPIC = "projects/bench/topics/ingest"
SUBSCRIPTION = "projects/bench/subscriptions/ingest-sub"
HOST = "127.0.0.1"
PUBLISH = "/google.pubsub.v1.Publisher/Publish"
PublishRequest: Any = pubsub_types.PublishRequest.pb()
PublishResponse: Any = pubsub_types.PublishResponse.pb()
PubsubMessage: Any = pubsub_types.PubsubMessage.pb()
Topic: Any = pubsub_types.Topic.pb()
Subscription: Any = pubsub_types.Subscription.pb()
_SOURCE = Path(__file__).resolve().parent.parent / "src"


def free_port() -> int:
    """A port of 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


def emulator_binary() -> Path | None:
    """Google's Pub/Sub emulator launcher, if installed: $PUBSUB_EMULATOR_BIN, else next to gcloud's SDK."""
    configured = os.environ.get("PUBSUB_EMULATOR_BIN")
    if configured:
        return Path(configured) if Path(configured).exists() else None
    gcloud = shutil.which("gcloud")
    if gcloud is None:
        return None
    sdk = Path(os.path.realpath(gcloud)).parent.parent
    candidate = sdk / "platform" / "pubsub-emulator" / "bin" / "cloud-pubsub-emulator"
    return candidate if candidate.exists() else None


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants now (Linux /proc; just ``pid`` where that is missing)."""
    found, pending = [], [pid]
    while pending:
        current = pending.pop()
        found.append(current)
        try:
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            continue
        pending.extend(int(child) for child in children)
    return found


class ServerProcess:
    """One server as a child process: ``hedgepub serve`` (SQLite or in memory) or Google's emulator.

    ``kind`` is "sqlite", "memory" or "emulator"; ``source`` runs ``hedgepub serve`` from another source
    tree (an older hedgepub). ``data_dir`` (SQLite) survives :meth:`kill`, so a restart reads it back.
    ``rest=False`` serves gRPC alone on the port (``--no-rest``).
    """

    def __init__(
        self,
        kind: str,
        data_dir: Path | None = None,
        source: Path | None = None,
        environment: dict[str, str] | None = None,
        rest: bool = True,
    ) -> None:
        self.kind = kind
        self.rest = rest
        #: Variables set in the server's environment besides PYTHONPATH.
        self.environment = environment or {}
        self.data_dir = data_dir
        self.source = source or _SOURCE
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        """``host:port`` for clients."""
        return f"{HOST}:{self.port}"

    def command(self) -> list[str]:
        """The command line that starts this server."""
        if self.kind == "emulator":
            binary = emulator_binary()
            if binary is None:
                raise FileNotFoundError("Google's Pub/Sub emulator is not installed")
            return [str(binary), f"--host={HOST}", f"--port={self.port}"]
        command = [sys.executable, "-c", "from hedgepub.cli import main; main()", "serve"]
        command += ["--host", HOST, "--port", str(self.port)]
        if not self.rest:
            command.append("--no-rest")
        if self.kind == "memory":
            return [*command, "--in-memory"]
        assert self.data_dir is not None
        return [*command, "--data-dir", str(self.data_dir)]

    def start(self, timeout: float = 120.0) -> float:
        """Start it and wait until it answers an RPC (GetTopic); returns the seconds that took."""
        environment = dict(os.environ, PYTHONPATH=str(self.source), **self.environment)
        started = time.perf_counter()
        self.process = subprocess.Popen(
            self.command(),
            env=environment,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        # The port first, with plain sockets: a gRPC channel that found nothing listening backs off for
        # a second or more before it tries again, which would be counted as restart time.
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.kind} server exited with {self.process.returncode}")
            try:
                with socket.create_connection((HOST, self.port), timeout=0.2):
                    break
            except OSError:
                pass
            if time.perf_counter() - started > timeout:
                raise TimeoutError(f"{self.kind} server did not listen within {timeout} s")
            time.sleep(0.005)
        channel = grpc.insecure_channel(self.address)
        try:
            get = channel.unary_unary(
                "/google.pubsub.v1.Publisher/GetTopic",
                request_serializer=lambda message: message.SerializeToString(),
            )
            try:
                get(pubsub_types.GetTopicRequest.pb()(topic=TOPIC), timeout=timeout, wait_for_ready=True)
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.NOT_FOUND:
                    raise
        finally:
            channel.close()
        return time.perf_counter() - started

    def rss_bytes(self) -> int:
        """Resident memory of the server process now (its children too, for the emulator's JVM)."""
        assert self.process is not None
        total = 0
        for pid in process_tree(self.process.pid):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            for line in status.splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        return total

    def kill(self) -> None:
        """SIGKILL the process group (nothing gets to flush)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.process = None

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it lingers."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()
        self.process = None


@dataclass(frozen=True)
class Run:
    """One timed run against one target."""

    target: str
    messages: int
    seconds: float
    rpc_p50_ms: float
    rpc_p99_ms: float

    @property
    def messages_per_second(self) -> float:
        return self.messages / self.seconds


def _serializer(message: Any) -> bytes:
    return message.SerializeToString()


async def create_topic_and_subscriptions(address: str, topic: str, subscriptions: list[str]) -> None:
    """CreateTopic and CreateSubscription (ack deadline 600 s) over raw gRPC."""
    async with grpc.aio.insecure_channel(address) as channel:
        await channel.unary_unary("/google.pubsub.v1.Publisher/CreateTopic", request_serializer=_serializer)(
            Topic(name=topic), timeout=30
        )
        create = channel.unary_unary(
            "/google.pubsub.v1.Subscriber/CreateSubscription", request_serializer=_serializer
        )
        for name in subscriptions:
            await create(Subscription(name=name, topic=topic, ack_deadline_seconds=600), timeout=30)


async def publish_requests(address: str, requests: int, publishers: int, request: bytes) -> Run:
    """Send ``requests`` copies of a serialized PublishRequest from ``publishers`` concurrent callers."""
    async with grpc.aio.insecure_channel(address) as channel:
        # Raw bytes in and out: no client-side (de)serialization inside the timed loop.
        publish = channel.unary_unary(PUBLISH)
        # Warm-up (connection, first transaction) outside the measurement.
        PublishResponse.FromString(await publish(request, timeout=60))

        remaining = requests
        latencies: list[float] = []
        acknowledged = 0

        async def publisher() -> None:
            nonlocal remaining, acknowledged
            while remaining > 0:
                remaining -= 1
                sent = time.perf_counter()
                response = await publish(request, timeout=120)
                latencies.append(time.perf_counter() - sent)
                acknowledged += len(PublishResponse.FromString(response).message_ids)

        started = time.perf_counter()
        await asyncio.gather(*(publisher() for _ in range(publishers)))
        seconds = time.perf_counter() - started
    latencies.sort()
    return Run(
        target="",
        messages=acknowledged,
        seconds=seconds,
        rpc_p50_ms=latencies[len(latencies) // 2] * 1e3,
        rpc_p99_ms=latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e3,
    )


def build_request(topic: str, batch: int, size: int) -> bytes:
    """A serialized PublishRequest of ``batch`` messages of ``size`` bytes."""
    return PublishRequest(
        topic=topic, messages=[PubsubMessage(data=b"x" * size) for _ in range(batch)]
    ).SerializeToString()


def measure(target: str, args: argparse.Namespace) -> Run:
    """Start a fresh ``target`` server, publish ``args.messages`` to a topic with a subscription, stop it."""
    kind = "sqlite" if target == "baseline" else target
    source = args.baseline_src if target == "baseline" else None
    with tempfile.TemporaryDirectory(prefix="hedgepub-ingest-") as data_dir:
        server = ServerProcess(kind, Path(data_dir), source)
        server.start()
        try:
            asyncio.run(create_topic_and_subscriptions(server.address, TOPIC, [SUBSCRIPTION]))
            requests = max(1, args.messages // args.batch)
            request = build_request(TOPIC, args.batch, args.size)
            run = asyncio.run(publish_requests(server.address, requests, args.publishers, request))
        finally:
            server.stop()
    if run.messages != (max(1, args.messages // args.batch)) * args.batch:
        raise RuntimeError(f"{target}: {run.messages} messages acknowledged, expected {args.messages}")
    return Run(target, run.messages, run.seconds, run.rpc_p50_ms, run.rpc_p99_ms)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print a table and the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=100_000, help="messages per target and round")
    parser.add_argument("--publishers", type=int, default=4, help="concurrent publishers")
    parser.add_argument("--batch", type=int, default=100, help="messages per Publish RPC")
    parser.add_argument("--size", type=int, default=100, help="bytes per message")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each runs every target")
    parser.add_argument(
        "--baseline-src", type=Path, help="the src/ directory of another hedgepub to run beside this one"
    )
    parser.add_argument("--no-emulator", action="store_true", help="leave Google's emulator out")
    args = parser.parse_args(argv)

    targets = ["sqlite", "memory"]
    if args.baseline_src is not None:
        targets.append("baseline")
    if not args.no_emulator:
        if emulator_binary() is not None:
            targets.append("emulator")
        else:
            print("Google's Pub/Sub emulator is not installed: skipped", file=sys.stderr)

    runs: list[Run] = []
    for round_number in range(args.rounds):
        # Rotate which target goes first, so that none always gets the warmer (or busier) machine.
        shift = round_number % len(targets)
        for target in targets[shift:] + targets[:shift]:
            run = measure(target, args)
            runs.append(run)
            print(
                f"round {round_number + 1} {target:>8}: {run.messages:,} messages in {run.seconds:.2f} s "
                f"= {run.messages_per_second:,.0f} msg/s",
                file=sys.stderr,
            )

    print()
    print(
        f"server ingest: {args.messages:,} messages of {args.size} B per round, {args.batch} per Publish, "
        f"{args.publishers} publishers, 1 subscription, {args.rounds} round(s); "
        f"{platform.python_implementation()} {platform.python_version()}, {platform.machine()}"
    )
    header = f"{'target':<9} {'msg/s (median)':>15} {'MB/s':>7} {'RPC p50 ms':>11} {'RPC p99 ms':>11}"
    print(header)
    print("-" * len(header))
    medians: dict[str, float] = {}
    for target in targets:
        mine = [run for run in runs if run.target == target]
        rate = statistics.median(run.messages_per_second for run in mine)
        medians[target] = rate
        p50 = statistics.median(run.rpc_p50_ms for run in mine)
        p99 = statistics.median(run.rpc_p99_ms for run in mine)
        print(f"{target:<9} {rate:>15,.0f} {rate * args.size / 1e6:>7.2f} {p50:>11.1f} {p99:>11.1f}")
    for other in targets[1:]:
        print(f"ratio sqlite / {other}: {medians['sqlite'] / medians[other]:.2f}")


if __name__ == "__main__":
    main()
