"""Publish throughput: the local server (SQLite, memory), Google's emulator cold and warm, side by side.

Each target runs as its own process (``hedgepub serve``, or Google's Pub/Sub emulator when it is
installed), so the benchmark's client never shares the server's interpreter. Four concurrent raw-gRPC
publishers send Publish RPCs of 100 messages of 100 bytes (serialized once up front, so the client costs
little and the server is what is measured) to a topic with one subscription (``--subscriptions N``: N), so
that every message is stored (and referenced by each subscription). Rounds alternate the order of the
targets, so a busy machine hurts all alike.

Targets:

* ``sqlite``, ``memory``: ``hedgepub serve`` (REST on, the default), a fresh process each round;
  ``sqlite-grpc``, ``memory-grpc``: the same with ``--no-rest`` (gRPC alone on the port);
* ``emulator-cold``: Google's emulator, a fresh JVM each round: what its first 100,000 messages see;
* ``emulator-warm``: one emulator for the whole run, warmed first (``--warm-messages`` messages, 500,000 by
  default, and more until it stops getting faster: the median CPU time per message of the last three
  chunks of 20,000 no more than 10% below that of the three before, at most three times as many),
  then measured each round on a new topic and subscription (deleted after the round, so that it does not
  keep the messages);
* ``baseline``, ``baseline-grpc``: an older hedgepub on SQLite (``--baseline-src``), REST on or off;
* ``floor``: a bare ``grpc.aio`` server in Python (this script with ``--serve-floor``) whose Publish parses
  the request and answers its message IDs, storing nothing: the most any server written on ``grpc.aio``
  in CPython can take on this machine, the ceiling of the ``memory`` target.

Each run prints messages/s and the server's CPU time per message (user + system of its process and its
children, from /proc on Linux), which a busy machine disturbs far less than the wall clock. The summary
gives medians with [min-max] over the rounds and the load average before and after.

    python benchmarks/server_ingest.py                      # 100,000 messages per target and round
    python benchmarks/server_ingest.py --messages 20000 --rounds 1 --publishers 8
    python benchmarks/server_ingest.py --targets sqlite,memory,emulator-warm --rounds 5
    python benchmarks/server_ingest.py --targets sqlite-grpc,memory-grpc --subscriptions 4 --no-emulator
    # An older hedgepub beside this one: its source tree's src/ directory, e.g. from
    #   git worktree add /tmp/old <commit>   (then --baseline-src /tmp/old/src)
    python benchmarks/server_ingest.py --baseline-src /tmp/old/src

The emulator is looked up as ``cloud-pubsub-emulator`` under the Google Cloud SDK that ``gcloud`` on PATH
belongs to (or ``$PUBSUB_EMULATOR_BIN``); it is skipped, with a note, when absent.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
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


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process ``pid`` and its descendants now (all threads), from /proc;
    None where /proc is missing."""
    total = 0.0
    for current in process_tree(pid):
        try:
            with open(f"/proc/{current}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            if current == pid:
                return None
            continue
        # Fields 14 and 15 of proc(5) (utime, stime), counted after the command name's closing parenthesis.
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as text ("n/a" where the platform has none)."""
    try:
        return "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except OSError:
        return "n/a"


def spread(values: list[float], fmt: str = ",.0f") -> str:
    """``median [min-max]`` of ``values``, each formatted with ``fmt``."""
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


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
        if self.kind == "floor":
            return [sys.executable, __file__, "--serve-floor", str(self.port)]
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

    def cpu_seconds(self) -> float | None:
        """User + system CPU time of the server so far (its children too), or None without /proc."""
        assert self.process is not None
        return cpu_seconds(self.process.pid)

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
    #: CPU time of the publishing process over the timed loop (its own cost, not the server's).
    client_cpu_seconds: float = 0.0
    #: The server's CPU time per message in microseconds over the run; None where it cannot be read.
    server_cpu_us: float | None = None

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

        started, cpu_started = time.perf_counter(), time.process_time()
        await asyncio.gather(*(publisher() for _ in range(publishers)))
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    latencies.sort()
    return Run(
        target="",
        messages=acknowledged,
        seconds=seconds,
        rpc_p50_ms=latencies[len(latencies) // 2] * 1e3,
        rpc_p99_ms=latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e3,
        client_cpu_seconds=cpu,
    )


def build_request(topic: str, batch: int, size: int) -> bytes:
    """A serialized PublishRequest of ``batch`` messages of ``size`` bytes."""
    return PublishRequest(
        topic=topic, messages=[PubsubMessage(data=b"x" * size) for _ in range(batch)]
    ).SerializeToString()


#: Every target: (server kind, REST on).
KINDS: dict[str, tuple[str, bool]] = {
    "sqlite": ("sqlite", True),
    "memory": ("memory", True),
    "sqlite-grpc": ("sqlite", False),
    "memory-grpc": ("memory", False),
    "baseline": ("sqlite", True),
    "baseline-grpc": ("sqlite", False),
    "floor": ("floor", False),
    "emulator-cold": ("emulator", False),
    "emulator-warm": ("emulator", False),
}
#: Messages per chunk while warming the emulator, how much better the last chunks may still be, and how
#: many chunks a median takes.
WARM_CHUNK = 20_000
WARM_STABLE = 0.10
#: The warm-up stops at this many times ``--warm-messages`` even if the emulator still gets better.
WARM_CAP = 3
WARM_STABLE_CHUNKS = 3


def subscription_names(subscription: str, count: int) -> list[str]:
    """``subscription`` and, with ``--subscriptions`` above 1, ``subscription-2`` .. ``subscription-N``."""
    return [subscription] + [f"{subscription}-{number}" for number in range(2, count + 1)]


def publish_and_measure(
    server: ServerProcess, topic: str, subscription: str, args: argparse.Namespace, messages: int
) -> Run:
    """Create ``topic`` with ``args.subscriptions`` subscriptions (named after ``subscription``) on
    ``server`` and publish ``messages`` to it; the server's CPU time is read before and after."""
    names = subscription_names(subscription, args.subscriptions)
    asyncio.run(create_topic_and_subscriptions(server.address, topic, names))
    requests = max(1, messages // args.batch)
    request = build_request(topic, args.batch, args.size)
    before = server.cpu_seconds()
    run = asyncio.run(publish_requests(server.address, requests, args.publishers, request))
    after = server.cpu_seconds()
    if run.messages != requests * args.batch:
        raise RuntimeError(f"{run.messages} messages acknowledged, expected {requests * args.batch}")
    server_cpu = None if before is None or after is None else (after - before) / run.messages * 1e6
    return Run(
        "", run.messages, run.seconds, run.rpc_p50_ms, run.rpc_p99_ms, run.client_cpu_seconds, server_cpu
    )


async def delete_topic_and_subscriptions(address: str, topic: str, subscriptions: list[str]) -> None:
    """DeleteSubscription, then DeleteTopic, over raw gRPC (a long-lived server lets the messages go)."""
    async with grpc.aio.insecure_channel(address) as channel:
        delete = channel.unary_unary(
            "/google.pubsub.v1.Subscriber/DeleteSubscription", request_serializer=_serializer
        )
        for name in subscriptions:
            await delete(pubsub_types.DeleteSubscriptionRequest.pb()(subscription=name), timeout=30)
        await channel.unary_unary("/google.pubsub.v1.Publisher/DeleteTopic", request_serializer=_serializer)(
            pubsub_types.DeleteTopicRequest.pb()(topic=topic), timeout=30
        )


def warm_up(server: ServerProcess, args: argparse.Namespace) -> tuple[int, list[float], bool, str]:
    """Publish to ``server`` in chunks of :data:`WARM_CHUNK` until at least ``args.warm_messages`` went and
    it stopped getting faster: the median of the last :data:`WARM_STABLE_CHUNKS` chunks no more than
    :data:`WARM_STABLE` better than that of the chunks before them (at most :data:`WARM_CAP` times
    ``args.warm_messages``). The default minimum is large because the JVM's optimizing compiler comes
    late: after 140,000 messages one run sat at 22 us of CPU per message for 100,000 messages, a plateau
    that a 1,000,000-message warm-up took down to 4 to 9 us.

    What is compared is the server's CPU time per message (its JIT's work shows there, and a busy machine
    disturbs it far less than the wall clock), or messages/s where /proc cannot be read. Medians of a few
    chunks, because single chunks of a JVM vary with its garbage collections. Returns the messages sent,
    each chunk's figure, whether it settled (False: it stopped at the cap), and the unit.
    """
    topic, subscription = TOPIC + "-warm-up", SUBSCRIPTION + "-warm-up"
    asyncio.run(create_topic_and_subscriptions(server.address, topic, [subscription]))
    request = build_request(topic, args.batch, args.size)
    sent, figures, unit = 0, [], "us CPU/msg"
    while True:
        before = server.cpu_seconds()
        run = asyncio.run(
            publish_requests(server.address, WARM_CHUNK // args.batch, args.publishers, request)
        )
        after = server.cpu_seconds()
        sent += run.messages
        if before is None or after is None:
            unit = "msg/s"
            figures.append(run.messages_per_second)
        else:
            figures.append((after - before) / run.messages * 1e6)
        print(
            f"  warming the emulator: {sent:,} messages, last chunk {run.messages_per_second:,.0f} msg/s, "
            f"{figures[-1]:,.1f} {unit}",
            file=sys.stderr,
        )
        stable = False
        if len(figures) >= 2 * WARM_STABLE_CHUNKS:
            last = statistics.median(figures[-WARM_STABLE_CHUNKS:])
            before = statistics.median(figures[-2 * WARM_STABLE_CHUNKS : -WARM_STABLE_CHUNKS])
            # Better is less CPU per message, or more messages per second.
            gain = (before - last) / before if unit != "msg/s" else (last - before) / before
            stable = gain <= WARM_STABLE
        if (sent >= args.warm_messages and stable) or sent >= WARM_CAP * args.warm_messages:
            break
    asyncio.run(delete_topic_and_subscriptions(server.address, topic, [subscription]))
    return sent, figures, stable, unit


def measure(target: str, args: argparse.Namespace, warm: ServerProcess | None, round_number: int) -> Run:
    """One run of ``target``: a fresh server (stopped after), or the warmed emulator ``warm`` on a topic of
    this round's (deleted after)."""
    if target == "emulator-warm":
        assert warm is not None
        topic, subscription = f"{TOPIC}-{round_number}", f"{SUBSCRIPTION}-{round_number}"
        run = publish_and_measure(warm, topic, subscription, args, args.messages)
        names = subscription_names(subscription, args.subscriptions)
        asyncio.run(delete_topic_and_subscriptions(warm.address, topic, names))
        return Run(target, *dataclasses.astuple(run)[1:])
    kind, rest = KINDS[target]
    source = args.baseline_src if target.startswith("baseline") else None
    with tempfile.TemporaryDirectory(prefix="hedgepub-ingest-") as data_dir:
        server = ServerProcess(kind, Path(data_dir), source, rest=rest)
        server.start()
        try:
            run = publish_and_measure(server, TOPIC, SUBSCRIPTION, args, args.messages)
        finally:
            server.stop()
    return Run(target, *dataclasses.astuple(run)[1:])


def serve_floor(port: int) -> None:
    """The ``floor`` target: a ``grpc.aio`` server whose Publish answers IDs and keeps nothing (every
    other method: UNIMPLEMENTED, and NOT_FOUND for GetTopic so that :meth:`ServerProcess.start` sees it
    answer)."""
    sequence = 1

    async def publish(request: Any, context: grpc.aio.ServicerContext) -> Any:
        nonlocal sequence
        first, sequence = sequence, sequence + len(request.messages)
        return PublishResponse(message_ids=list(map(str, range(first, sequence))))

    async def get_topic(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.NOT_FOUND, "no topics here")

    async def accept(request: Any, context: grpc.aio.ServicerContext) -> Any:
        return request  # CreateTopic, CreateSubscription: nothing to create

    def unary(behavior: Any, parse: Any) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(
            behavior, request_deserializer=parse, response_serializer=_serializer
        )

    async def run() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "google.pubsub.v1.Publisher",
                    {
                        "Publish": unary(publish, PublishRequest.FromString),
                        "GetTopic": unary(get_topic, pubsub_types.GetTopicRequest.pb().FromString),
                        "CreateTopic": unary(accept, Topic.FromString),
                    },
                ),
                grpc.method_handlers_generic_handler(
                    "google.pubsub.v1.Subscriber",
                    {"CreateSubscription": unary(accept, Subscription.FromString)},
                ),
            )
        )
        server.add_insecure_port(f"{HOST}:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(run())


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print a table and the ratios."""
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--serve-floor":
        serve_floor(int(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=100_000, help="messages per target and round")
    parser.add_argument("--publishers", type=int, default=4, help="concurrent publishers")
    parser.add_argument("--batch", type=int, default=100, help="messages per Publish RPC")
    parser.add_argument("--size", type=int, default=100, help="bytes per message")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each runs every target")
    parser.add_argument(
        "--subscriptions", type=int, default=1, help="subscriptions on the topic (each stores every message)"
    )
    parser.add_argument(
        "--targets",
        default="sqlite,memory,emulator-cold,emulator-warm,floor",
        help=f"comma-separated, of: {', '.join(KINDS)} (baseline is added by --baseline-src if none is)",
    )
    parser.add_argument(
        "--warm-messages", type=int, default=500_000, help="messages that warm the emulator at least"
    )
    parser.add_argument(
        "--baseline-src", type=Path, help="the src/ directory of another hedgepub to run beside this one"
    )
    parser.add_argument("--no-emulator", action="store_true", help="leave Google's emulator out")
    args = parser.parse_args(argv)

    targets = [name for name in args.targets.split(",") if name]
    unknown = set(targets) - set(KINDS)
    if unknown:
        raise SystemExit(f"unknown targets: {', '.join(sorted(unknown))}")
    if args.baseline_src is not None and not any(name.startswith("baseline") for name in targets):
        targets.append("baseline")
    if any(name.startswith("baseline") for name in targets) and args.baseline_src is None:
        raise SystemExit("the baseline target needs --baseline-src")
    if args.no_emulator or emulator_binary() is None:
        if not args.no_emulator:
            print("Google's Pub/Sub emulator is not installed: skipped", file=sys.stderr)
        targets = [name for name in targets if not name.startswith("emulator")]

    load_before = load_average()
    warm: ServerProcess | None = None
    warm_note = ""
    if "emulator-warm" in targets:
        warm = ServerProcess("emulator")
        warm.start()
        sent, figures, stable, unit = warm_up(warm, args)
        settled = (
            f"the last {WARM_STABLE_CHUNKS} no more than {WARM_STABLE:.0%} better than the "
            f"{WARM_STABLE_CHUNKS} before"
            if stable
            else f"stopped at the cap, still getting better by more than {WARM_STABLE:.0%}"
        )
        warm_note = (
            f"emulator-warm: warmed with {sent:,} messages in chunks of {WARM_CHUNK:,} (first chunk "
            f"{figures[0]:,.1f} {unit}; {settled}: "
            f"{', '.join(f'{figure:,.1f}' for figure in figures[-WARM_STABLE_CHUNKS:])} {unit})"
        )
    runs: list[Run] = []
    try:
        for round_number in range(args.rounds):
            # Rotate which target goes first, so that none always gets the warmer (or busier) machine.
            shift = round_number % len(targets)
            for target in targets[shift:] + targets[:shift]:
                run = measure(target, args, warm, round_number)
                runs.append(run)
                cpu = "" if run.server_cpu_us is None else f", server CPU {run.server_cpu_us:.1f} us/msg"
                print(
                    f"round {round_number + 1} {target:>13}: {run.messages:,} messages in "
                    f"{run.seconds:.2f} s = {run.messages_per_second:,.0f} msg/s{cpu}  "
                    f"(load {load_average()})",
                    file=sys.stderr,
                )
    finally:
        if warm is not None:
            warm.stop()

    print()
    print(
        f"server ingest: {args.messages:,} messages of {args.size} B per round, {args.batch} per Publish, "
        f"{args.publishers} publishers, {args.subscriptions} subscription(s), {args.rounds} round(s); "
        f"{platform.python_implementation()} {platform.python_version()}, {platform.machine()}; "
        f"load average {load_before} before, {load_average()} after"
    )
    if warm_note:
        print(warm_note)
    header = (
        f"{'target':<14} {'msg/s median [min-max]':>26} {'server CPU us/msg':>22} "
        f"{'RPC p50 ms':>11} {'RPC p99 ms':>11}"
    )
    print(header)
    print("-" * len(header))
    medians: dict[str, float] = {}
    cpu_medians: dict[str, float] = {}
    for target in targets:
        mine = [run for run in runs if run.target == target]
        rates = [run.messages_per_second for run in mine]
        medians[target] = statistics.median(rates)
        cpus = [run.server_cpu_us for run in mine if run.server_cpu_us is not None]
        cpu_text = spread(cpus, ".1f") if len(cpus) == len(mine) else "n/a"
        if cpu_text != "n/a":
            cpu_medians[target] = statistics.median(cpus)
        p50 = statistics.median(run.rpc_p50_ms for run in mine)
        p99 = statistics.median(run.rpc_p99_ms for run in mine)
        print(f"{target:<14} {spread(rates):>26} {cpu_text:>22} {p50:>11.1f} {p99:>11.1f}")
    for first, second in (
        ("sqlite", "emulator-warm"),
        ("memory", "emulator-warm"),
        ("sqlite-grpc", "emulator-warm"),
        ("memory-grpc", "emulator-warm"),
        ("sqlite", "emulator-cold"),
        ("memory", "emulator-cold"),
        ("sqlite", "baseline"),
        ("sqlite-grpc", "baseline-grpc"),
        ("sqlite", "memory"),
        ("memory-grpc", "floor"),
        ("sqlite-grpc", "floor"),
        ("emulator-warm", "floor"),
        ("memory", "memory-grpc"),
        ("sqlite", "sqlite-grpc"),
    ):
        if first in medians and second in medians:
            by_cpu = (
                f", {cpu_medians[second] / cpu_medians[first]:.2f}x by server CPU per message"
                if first in cpu_medians and second in cpu_medians
                else ""
            )
            print(f"ratio {first} / {second}: {medians[first] / medians[second]:.2f}x msg/s{by_cpu}")


if __name__ == "__main__":
    main()
