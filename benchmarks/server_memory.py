"""Server memory and restarts: RSS against backlog and subscriptions, SIGKILL restarts, acknowledged data.

Every server runs as its own process (``hedgepub serve``, see ``server_ingest.ServerProcess``); the
figures are its resident set size (VmRSS) and, for SQLite, the size of the database file and its WAL.

- ``backlog``: one subscription, a backlog of 0, 100,000 and 1,000,000 messages: RSS with the backlog
  waiting and one Pull (1,000 messages) leased, then SIGKILL, restart (seconds from process start until
  it answers an RPC, and RSS), and RSS after the same Pull again.
- ``subscriptions``: 1, 50 and 200 subscriptions on one topic, each holding the same 20,000 messages:
  the same figures.
- ``acked``: 500,000 messages published and acknowledged in chunks through the in-memory server (RSS
  before and after), and 300,000 through SQLite (file size before and after); then 100,000 published
  to SQLite first and acknowledged afterwards (file size, and how the incremental vacuum shrinks it).

    python benchmarks/server_memory.py                         # everything, full sizes (several minutes)
    python benchmarks/server_memory.py backlog --backlogs 0,100000
    python benchmarks/server_memory.py subscriptions --baseline-src /tmp/old/src   # beside an older hedgepub
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc.aio
from google.pubsub_v1.types import pubsub as pubsub_types

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_ingest import (  # a sibling script, not a package
    TOPIC,
    ServerProcess,
    build_request,
    create_topic_and_subscriptions,
    publish_requests,
)

PullRequest: Any = pubsub_types.PullRequest.pb()
PullResponse: Any = pubsub_types.PullResponse.pb()
AcknowledgeRequest: Any = pubsub_types.AcknowledgeRequest.pb()
MIB = 1024 * 1024


def _subscription(index: int) -> str:
    return f"projects/bench/subscriptions/memory-{index}"


@dataclass(frozen=True)
class Restart:
    """One backlog, before and after a SIGKILL restart."""

    target: str
    label: str
    rss_before: int
    restart_seconds: float
    rss_restarted: int
    rss_after_pull: int
    file_bytes: int


async def pull_once(address: str, subscription: str, ack: bool = False) -> int:
    """One Pull of up to 1,000 messages (acknowledged if ``ack``); how many came."""
    async with grpc.aio.insecure_channel(address) as channel:
        pull = channel.unary_unary(
            "/google.pubsub.v1.Subscriber/Pull",
            request_serializer=lambda message: message.SerializeToString(),
            response_deserializer=PullResponse.FromString,
        )
        response = await pull(PullRequest(subscription=subscription, max_messages=1000), timeout=60)
        received = list(response.received_messages)
        if ack and received:
            await channel.unary_unary(
                "/google.pubsub.v1.Subscriber/Acknowledge",
                request_serializer=lambda message: message.SerializeToString(),
            )(AcknowledgeRequest(subscription=subscription, ack_ids=[r.ack_id for r in received]), timeout=60)
        return len(received)


async def drain(address: str, subscription: str, expected: int) -> None:
    """Pull and acknowledge until ``expected`` messages came."""
    async with grpc.aio.insecure_channel(address) as channel:
        pull = channel.unary_unary(
            "/google.pubsub.v1.Subscriber/Pull",
            request_serializer=lambda message: message.SerializeToString(),
            response_deserializer=PullResponse.FromString,
        )
        acknowledge = channel.unary_unary(
            "/google.pubsub.v1.Subscriber/Acknowledge",
            request_serializer=lambda message: message.SerializeToString(),
        )
        received = 0
        while received < expected:
            response = await pull(PullRequest(subscription=subscription, max_messages=1000), timeout=60)
            ack_ids = [r.ack_id for r in response.received_messages]
            if ack_ids:
                await acknowledge(AcknowledgeRequest(subscription=subscription, ack_ids=ack_ids), timeout=60)
            received += len(ack_ids)


def _file_bytes(data_dir: Path) -> int:
    return sum(path.stat().st_size for path in data_dir.glob("pubsub.sqlite3*"))


def restart_case(
    target: str, source: Path | None, label: str, messages: int, subscriptions: int, size: int
) -> Restart:
    """Publish a backlog to ``subscriptions`` subscriptions, SIGKILL, restart, Pull once from each."""
    with tempfile.TemporaryDirectory(prefix="hedgepub-memory-") as data_dir:
        server = ServerProcess("sqlite", Path(data_dir), source)
        server.start()
        try:
            names = [_subscription(i) for i in range(subscriptions)]
            asyncio.run(create_topic_and_subscriptions(server.address, TOPIC, names))
            batch = 1000 if size <= 1000 else 100
            if messages:
                request = build_request(TOPIC, batch, size)
                asyncio.run(publish_requests(server.address, max(1, messages // batch) - 1, 4, request))
            # The server at work: each subscription has had one Pull (its leases and window in memory).
            for name in names:
                if messages:
                    asyncio.run(pull_once(server.address, name))
            time.sleep(1.0)  # let the writer settle
            rss_before = server.rss_bytes()
            server.kill()
            seconds = server.start()
            rss_restarted = server.rss_bytes()
            for name in names:
                if messages:
                    asyncio.run(pull_once(server.address, name))
            rss_after_pull = server.rss_bytes()
            file_bytes = _file_bytes(Path(data_dir))
        finally:
            server.kill()
    return Restart(target, label, rss_before, seconds, rss_restarted, rss_after_pull, file_bytes)


def print_restarts(title: str, cases: Sequence[Restart]) -> None:
    """A table of restart cases."""
    print()
    print(title)
    header = (
        f"{'target':<9} {'case':<22} {'RSS before':>11} {'restart s':>10} {'RSS after':>10} "
        f"{'ratio':>6} {'RSS 1st pull':>13} {'file MiB':>9}"
    )
    print(header)
    print("-" * len(header))
    for case in cases:
        print(
            f"{case.target:<9} {case.label:<22} {case.rss_before / MIB:>9.0f}Mi "
            f"{case.restart_seconds:>10.2f} "
            f"{case.rss_restarted / MIB:>8.0f}Mi {case.rss_restarted / case.rss_before:>6.2f} "
            f"{case.rss_after_pull / MIB:>11.0f}Mi {case.file_bytes / MIB:>9.1f}"
        )


def acked_case(kind: str, messages: int, size: int, chunk: int) -> tuple[int, int, int, int]:
    """Publish and acknowledge ``messages`` in chunks; (RSS, file) before and after."""
    with tempfile.TemporaryDirectory(prefix="hedgepub-acked-") as data_dir:
        server = ServerProcess(kind, Path(data_dir))
        server.start()
        try:
            subscription = _subscription(0)
            asyncio.run(create_topic_and_subscriptions(server.address, TOPIC, [subscription]))
            request = build_request(TOPIC, 1000, size)
            # A first chunk warms everything up (imports, caches, allocator pools) before "before".
            asyncio.run(publish_requests(server.address, chunk // 1000 - 1, 4, request))
            asyncio.run(drain(server.address, subscription, chunk))
            time.sleep(0.5)
            rss_before, file_before = server.rss_bytes(), _file_bytes(Path(data_dir))
            for _ in range(max(1, messages // chunk)):
                asyncio.run(publish_requests(server.address, chunk // 1000 - 1, 4, request))
                asyncio.run(drain(server.address, subscription, chunk))
            time.sleep(0.5)
            rss_after, file_after = server.rss_bytes(), _file_bytes(Path(data_dir))
        finally:
            server.stop()
    return rss_before, rss_after, file_before, file_after


def bulk_case(messages: int, size: int, settle: float) -> tuple[int, int, int]:
    """Publish ``messages`` to SQLite, then acknowledge them all: file after publishing, right after the
    last acknowledgement, and ``settle`` seconds later (the incremental vacuum works while idle)."""
    with tempfile.TemporaryDirectory(prefix="hedgepub-bulk-") as data_dir:
        server = ServerProcess("sqlite", Path(data_dir))
        server.start()
        try:
            subscription = _subscription(0)
            asyncio.run(create_topic_and_subscriptions(server.address, TOPIC, [subscription]))
            request = build_request(TOPIC, 1000, size)
            asyncio.run(publish_requests(server.address, messages // 1000 - 1, 4, request))
            published = _file_bytes(Path(data_dir))
            asyncio.run(drain(server.address, subscription, messages))
            acknowledged = _file_bytes(Path(data_dir))
            time.sleep(settle)
            settled = _file_bytes(Path(data_dir))
        finally:
            server.stop()
    return published, acknowledged, settled


def main(argv: list[str] | None = None) -> None:
    """Run the chosen parts and print their tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", default=["backlog", "subscriptions", "acked"])
    parser.add_argument("--backlogs", default="0,100000,1000000", help="backlog sizes (one subscription)")
    parser.add_argument("--subscriptions", default="1,50,200", help="subscription counts")
    parser.add_argument("--fanout-messages", type=int, default=20_000, help="messages on each subscription")
    parser.add_argument("--size", type=int, default=100, help="bytes per message (backlog, subscriptions)")
    parser.add_argument("--acked-memory", type=int, default=500_000, help="messages through the memory store")
    parser.add_argument("--acked-sqlite", type=int, default=300_000, help="messages through SQLite")
    parser.add_argument("--acked-size", type=int, default=1000, help="bytes per acknowledged message")
    parser.add_argument("--bulk", type=int, default=100_000, help="SQLite: published first, then acked")
    parser.add_argument("--baseline-src", type=Path, help="the src/ directory of another hedgepub to compare")
    args = parser.parse_args(argv)
    targets: list[tuple[str, Path | None]] = [("sqlite", None)]
    if args.baseline_src is not None:
        targets.append(("baseline", args.baseline_src))
    print(f"{platform.python_implementation()} {platform.python_version()}, {platform.machine()}")

    if "backlog" in args.parts:
        cases = [
            restart_case(target, source, f"backlog {int(n):,}", int(n), 1, args.size)
            for n in args.backlogs.split(",")
            for target, source in targets
        ]
        print_restarts(
            f"RSS against backlog ({args.size} B messages, 1 subscription), SIGKILL restart", cases
        )
    if "subscriptions" in args.parts:
        cases = [
            restart_case(
                target,
                source,
                f"{int(n)} x {args.fanout_messages:,}",
                args.fanout_messages,
                int(n),
                args.size,
            )
            for n in args.subscriptions.split(",")
            for target, source in targets
        ]
        print_restarts(f"RSS against subscriptions ({args.size} B messages), SIGKILL restart", cases)
    if "acked" in args.parts:
        print()
        print(f"acknowledged messages ({args.acked_size} B, published and drained in chunks of 10,000)")
        rss_before, rss_after, _, _ = acked_case("memory", args.acked_memory, args.acked_size, 10_000)
        print(
            f"in memory, {args.acked_memory:,}: RSS {rss_before / MIB:.0f} MiB -> {rss_after / MIB:.0f} MiB "
            f"({rss_after / rss_before:.2f}x)"
        )
        rss_before, rss_after, file_before, file_after = acked_case(
            "sqlite", args.acked_sqlite, args.acked_size, 10_000
        )
        print(
            f"SQLite, {args.acked_sqlite:,}: file {file_before / MIB:.1f} MiB -> {file_after / MIB:.1f} MiB, "
            f"RSS {rss_before / MIB:.0f} MiB -> {rss_after / MIB:.0f} MiB"
        )
        published, acknowledged, settled = bulk_case(args.bulk, args.acked_size, 10.0)
        print(
            f"SQLite, {args.bulk:,} published first, then all acknowledged: file {published / MIB:.1f} MiB, "
            f"{acknowledged / MIB:.1f} MiB at the last acknowledgement, {settled / MIB:.1f} MiB 10 s later"
        )


if __name__ == "__main__":
    main()
