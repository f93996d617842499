"""What ``hedgepub proxy`` costs and what it buys: the official clients through the proxy against the same
clients straight to the server, and against hedgepub's own publisher.

Servers and proxies are child processes (``hedgepub serve --in-memory --no-rest``, ``hedgepub proxy``);
every client run is a fresh process (this script with ``--child``, or Node.js), and the runs being
compared take turns round after round (the one that goes first rotates), so that they share the machine's
noise. Figures are medians with [min-max] over the rounds, ratios taken round by round, with the load
average.

**Cost** (the default): a healthy server, the official Python client (google-cloud-pubsub), 100-byte
messages, straight to the server (``direct``) and through the proxy (``proxy``, hedging on with a 1 s
delay that a healthy server never reaches):

* throughput: ``--messages`` published with the client's default batching, futures collected, messages/s;
* latency: ``--latency-publishes`` publishes one after another, each in a request of its own, p50 and p99;
  the proxy's added p50 is the difference of the medians;
* the proxy's CPU per message: its process's user + system CPU over the throughput run, per message;
* CPU per request (raw gRPC, 8 concurrent callers, ``--requests`` each round): the proxy's per Publish of
  100 messages it hedges and per GetTopic it forwards as bytes, and the server's per GetTopic it answers,
  which says what a gRPC call costs on the machine at that moment.

**Tails** (``--tails``): the server draws each Publish's latency from ``--mix`` (the reference mix: 95%
5 ms, 4% 300 ms, 1% 4 s, seeded); publishes go at ``--rate`` per second for ``--seconds``, each in a
request of its own, after a warm-up that fills the token buckets. Clients: the official Python client
straight to the server (no hedging) and through the proxy, hedgepub's ``PublisherClient`` with the same
hedging (``--hedge-delay`` 0.1 s, 50 tokens, refill 0.1), and the Node.js client straight and through the
proxy (where ``tests/interop/node`` has its ``node_modules``). Each row: p50, p99, p99.9, max and Publish
attempts per publish (the proxy's own count, from its exit line; hedgepub's from its stats). The proxied
official clients' p99 and p99.9 are compared with hedgepub's own.

    python benchmarks/proxy.py [--rounds 3] [--messages 20000] [--latency-publishes 500]
    python benchmarks/proxy.py --tails [--rounds 3] [--rate 100] [--seconds 30] [--no-node]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_ingest import HOST, ServerProcess, cpu_seconds, load_average, spread

PROJECT = "proxy-bench"
PAYLOAD = b"x" * 100
#: The reference latency mix of the issue (and of the Go and Rust clients' hedging benchmark).
REFERENCE_MIX = "95%:5ms,4%:300ms,1%:4s"
NODE_DIR = Path(__file__).resolve().parent.parent / "tests" / "interop" / "node"
_SOURCE = Path(__file__).resolve().parent.parent / "src"
_CLI = [sys.executable, "-c", "from hedgepub.cli import main; main()"]


class FaultyServer(ServerProcess):
    """``hedgepub serve --in-memory --no-rest`` with ``--fault`` rules and a ``--seed``."""

    def __init__(self, faults: list[str], seed: int) -> None:
        super().__init__("memory", rest=False)
        self.faults = faults
        self.seed = seed

    def command(self) -> list[str]:
        extra = [argument for rule in self.faults for argument in ("--fault", rule)]
        return [*super().command(), *extra, "--seed", str(self.seed)]


class ProxyProcess:
    """``hedgepub proxy`` as a child process on an ephemeral port; its stderr kept for its exit line."""

    def __init__(self, upstream: str, *arguments: str) -> None:
        self._log = tempfile.NamedTemporaryFile(prefix="hedgepub-proxy-", suffix=".log", delete=False)  # noqa: SIM115
        command = [*_CLI, "proxy", "--listen", f"{HOST}:0", "--upstream", upstream, *arguments]
        environment = dict(os.environ, PYTHONPATH=str(_SOURCE))
        self.process = subprocess.Popen(
            command, env=environment, stdout=subprocess.PIPE, stderr=self._log, start_new_session=True
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline().decode().strip()
        prefix = "export PUBSUB_EMULATOR_HOST="
        if not line.startswith(prefix):
            self.stop()
            raise RuntimeError(f"hedgepub proxy did not start: {line!r}\n{self.log()}")
        self.address = line[len(prefix) :]

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def cpu_seconds(self) -> float | None:
        """User + system CPU of the proxy process so far (None without /proc)."""
        return cpu_seconds(self.process.pid)

    def stop(self) -> dict[str, int]:
        """SIGTERM; the counts of its exit line (publishes forwarded, attempts, hedges sent and won)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        text = self.log()
        os.unlink(self._log.name)
        found = re.search(
            r"proxy: (\d+) publishes forwarded .*?, (\d+) attempts, (\d+) hedges sent, (\d+) won", text
        )
        if found is None:
            return {}
        publishes, attempts, hedges, won = map(int, found.groups())
        return {"publishes": publishes, "attempts": attempts, "hedges": hedges, "won": won}


def percentile(values: list[float], share: float) -> float:
    """The ``share`` (0-100) percentile of ``values``, nearest rank."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(share / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


# ---- the child: one client run in a fresh process --------------------------------------------------------


def child(options: argparse.Namespace) -> dict[str, Any]:
    """Run one measurement (``--child KIND``) against ``--address``; its figures."""
    os.environ["PUBSUB_EMULATOR_HOST"] = options.address
    from google.cloud import pubsub_v1
    from google.cloud.pubsub_v1.types import BatchSettings

    topic = f"projects/{PROJECT}/topics/{options.topic}"
    admin = pubsub_v1.PublisherClient()
    admin.create_topic(name=topic)
    if options.child == "throughput":
        publisher = admin
        for future in [publisher.publish(topic, PAYLOAD) for _ in range(2000)]:  # warm-up
            future.result()
        started = time.perf_counter()
        futures = [publisher.publish(topic, PAYLOAD) for _ in range(options.messages)]
        for future in futures:
            future.result()
        return {"rate": options.messages / (time.perf_counter() - started)}
    if options.child == "latency":
        publisher = pubsub_v1.PublisherClient(BatchSettings(max_messages=1))
        latencies = []
        for number in range(100 + options.latency_publishes):
            started = time.perf_counter()
            publisher.publish(topic, PAYLOAD).result()
            if number >= 100:  # after a warm-up
                latencies.append(time.perf_counter() - started)
        return {"p50": percentile(latencies, 50), "p99": percentile(latencies, 99)}
    return _tail_child(options, topic)


def _tail_child(options: argparse.Namespace, topic: str) -> dict[str, Any]:
    """Publishes at a fixed rate, each in a request of its own: each one's latency, and (hedgepub) its
    attempts."""
    import threading

    count = round(options.rate * options.seconds)
    latencies: list[float] = [0.0] * count
    done = threading.Semaphore(0)
    stats: Any = None
    if options.child == "tail-hedgepub":
        from hedgepub import BatchSettings, HedgingSettings, PublisherClient

        hedging = HedgingSettings(hedge_delay=options.hedge_delay, max_tokens=50, refill_ratio=0.1)
        client: Any = PublisherClient(
            BatchSettings(max_messages=1), hedging_settings=hedging, endpoint=options.address
        )
    else:
        from google.cloud import pubsub_v1
        from google.cloud.pubsub_v1.types import BatchSettings as OfficialBatchSettings

        client = pubsub_v1.PublisherClient(OfficialBatchSettings(max_messages=1))
    for _ in range(options.warm_up):  # fills the token buckets where there are some
        client.publish(topic, b"warm-up").result()
    if options.child == "tail-hedgepub":
        before = client.stats()
    started = time.perf_counter()
    for number in range(count):
        wait = started + number / options.rate - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        sent = time.perf_counter()

        def finished(_future: Any, number: int = number, sent: float = sent) -> None:
            latencies[number] = time.perf_counter() - sent
            done.release()

        client.publish(topic, PAYLOAD).add_done_callback(finished)
    for _ in range(count):
        done.acquire()
    figures: dict[str, Any] = {"latencies": latencies}
    if options.child == "tail-hedgepub":
        stats = client.stats()
        figures["attempts"] = stats.attempts_sent - before.attempts_sent
        figures["publishes"] = stats.batches_sent - before.batches_sent
        client.shutdown()
    return figures


def run_child(kind: str, address: str, topic: str, options: argparse.Namespace) -> dict[str, Any]:
    """Run measurement ``kind`` in a fresh Python process; its figures."""
    command = [sys.executable, os.path.abspath(__file__), "--child", kind, "--address", address]
    command += ["--topic", topic, "--messages", str(options.messages)]
    command += ["--latency-publishes", str(options.latency_publishes), "--rate", str(options.rate)]
    command += ["--seconds", str(options.seconds), "--warm-up", str(options.warm_up)]
    command += ["--hedge-delay", str(options.hedge_delay)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{kind} against {address} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    figures: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def run_node(address: str, options: argparse.Namespace) -> list[float]:
    """The Node.js client's fixed-rate latencies (seconds) against ``address``."""
    environment = dict(
        os.environ,
        PUBSUB_EMULATOR_HOST=address,
        INTEROP_PROJECT=PROJECT,
        LATENCY_MESSAGES=str(round(options.rate * options.seconds)),
        LATENCY_RATE=str(options.rate),
        LATENCY_WARM_UP=str(options.warm_up),
    )
    done = subprocess.run(
        ["node", "publish_latency.mjs"],
        cwd=NODE_DIR,
        env=environment,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"publish_latency.mjs failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    return [milliseconds / 1000 for milliseconds in summary["latenciesMs"]]


# ---- the parent -----------------------------------------------------------------------------------------


def _order(names: list[str], round_number: int) -> list[str]:
    shift = round_number % len(names)
    return names[shift:] + names[:shift]


def cost(options: argparse.Namespace) -> None:
    """Throughput, latency and the proxy's CPU per message, direct against through the proxy."""
    server = ServerProcess("memory", rest=False)
    server.start()
    proxy = ProxyProcess(server.address, "--hedge-delay", "1")
    figures: dict[str, dict[str, list[float]]] = {
        name: {"rate": [], "p50": [], "p99": []} for name in ("direct", "proxy")
    }
    cpu_per_message: list[float] = []
    cpu_per_request: dict[str, list[float]] = {}
    load_before = load_average()
    try:
        for round_number in range(options.rounds):
            for label, values in per_request(server, proxy, options.requests).items():
                cpu_per_request.setdefault(label, []).extend(values)
            for name in _order(["direct", "proxy"], round_number):
                address = proxy.address if name == "proxy" else server.address
                cpu_before = proxy.cpu_seconds()
                rate = run_child("throughput", address, f"rate-{round_number}-{name}", options)["rate"]
                cpu_after = proxy.cpu_seconds()
                if name == "proxy" and cpu_before is not None and cpu_after is not None:
                    cpu_per_message.append((cpu_after - cpu_before) / (options.messages + 2000) * 1e6)
                latency = run_child("latency", address, f"latency-{round_number}-{name}", options)
                figures[name]["rate"].append(rate)
                figures[name]["p50"].append(latency["p50"] * 1e3)
                figures[name]["p99"].append(latency["p99"] * 1e3)
                p50, p99 = latency["p50"] * 1e3, latency["p99"] * 1e3
                print(
                    f"round {round_number + 1} {name:>6}: {rate:>8,.0f} msg/s, p50 {p50:.2f} ms, "
                    f"p99 {p99:.2f} ms (load {load_average()})",
                    flush=True,
                )
    finally:
        proxy.stop()
        server.stop()

    def ratio(key: str) -> str:
        ratios = [p / d for p, d in zip(figures["proxy"][key], figures["direct"][key], strict=True)]
        return spread(ratios, ".2f") + "x"

    added = [p - d for p, d in zip(figures["proxy"]["p50"], figures["direct"]["p50"], strict=True)]
    print()
    print(
        f"official Python client, {len(PAYLOAD)}-byte messages, {options.rounds} rounds (medians [min-max]); "
        f"load average {load_before} before, {load_average()} after"
    )
    print(f"{'':>22} {'direct':>26} {'through the proxy':>26} {'proxy / direct':>22}")
    for key, label, fmt in (
        ("rate", "throughput (msg/s)", ",.0f"),
        ("p50", "p50 (ms)", ".2f"),
        ("p99", "p99 (ms)", ".2f"),
    ):
        print(
            f"{label:>22} {spread(figures['direct'][key], fmt):>26} {spread(figures['proxy'][key], fmt):>26} "
            f"{ratio(key):>22}"
        )
    print(f"{'added p50 (ms)':>22} {spread(added, '.2f'):>53}")
    if cpu_per_message:
        print(f"{'proxy CPU (us/msg)':>22} {spread(cpu_per_message, '.1f'):>53}")
    for label, values in cpu_per_request.items():
        print(f"CPU per request, {label} (raw gRPC, 8 callers): {spread(values, ',.0f')} us")


def per_request(server: ServerProcess, proxy: ProxyProcess, requests: int) -> dict[str, list[float]]:
    """CPU microseconds per request of the proxy (a Publish of 100 messages it hedges, a GetTopic it
    forwards as bytes) and of the server (a GetTopic it answers), raw gRPC from 8 concurrent callers."""
    import asyncio

    import grpc

    from hedgepub._transport.grpc import PublishRequestPb
    from hedgepub.admin import AdminClient

    topic = f"projects/{PROJECT}/topics/per-request-{time.monotonic_ns()}"
    with AdminClient(server.address) as admin:
        admin.create_topic(topic)
    publish = PublishRequestPb(topic=topic)
    for _ in range(100):
        publish.messages.add(data=PAYLOAD)
    get = PublishRequestPb(topic=topic).SerializeToString()  # a GetTopicRequest's field 1 is its topic too

    async def drive(address: str, method: str, request: bytes) -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            call = channel.unary_unary(method)

            async def caller() -> None:
                for _ in range(requests // 8):
                    await call(request, timeout=60)

            await asyncio.gather(*(caller() for _ in range(8)))

    runs = [
        ("proxy, Publish of 100 (hedged)", proxy, proxy.address, "Publish", publish.SerializeToString()),
        ("proxy, GetTopic (bytes)", proxy, proxy.address, "GetTopic", get),
        ("server, GetTopic", server, server.address, "GetTopic", get),
    ]
    figures: dict[str, list[float]] = {}
    for label, process, address, method, request in runs:
        before = process.cpu_seconds()
        asyncio.run(drive(address, f"/google.pubsub.v1.Publisher/{method}", request))
        after = process.cpu_seconds()
        if before is not None and after is not None:
            figures[label] = [(after - before) / (requests // 8 * 8) * 1e6]
    return figures


def tails(options: argparse.Namespace) -> None:
    """The tail latency of each client under the latency mix, with and without the proxy."""
    names = ["official-direct", "official-proxy", "hedgepub"]
    if options.node and shutil.which("node") and (NODE_DIR / "node_modules" / "@google-cloud").is_dir():
        names += ["node-direct", "node-proxy"]
    delay = f"{options.hedge_delay:g}"
    rows: dict[str, dict[str, list[float]]] = {
        name: {"p50": [], "p99": [], "p999": [], "max": [], "attempts": []} for name in names
    }
    load_before = load_average()
    for round_number in range(options.rounds):
        server = FaultyServer([f"Publish:latency={options.mix}"], seed=round_number)
        server.start()
        try:
            for name in _order(names, round_number):
                proxy = None
                if name.endswith("-proxy"):
                    proxy = ProxyProcess(
                        server.address, "--hedge-delay", delay, "--max-tokens", "50", "--refill-ratio", "0.1"
                    )
                address = proxy.address if proxy is not None else server.address
                attempts = 1.0
                try:
                    if name.startswith("node"):
                        latencies = run_node(address, options)
                    else:
                        kind = "tail-hedgepub" if name == "hedgepub" else "tail-official"
                        figures = run_child(kind, address, f"tail-{round_number}-{name}", options)
                        latencies = figures["latencies"]
                        if name == "hedgepub":
                            attempts = figures["attempts"] / max(1, figures["publishes"])
                finally:
                    counts = proxy.stop() if proxy is not None else {}
                if counts:
                    attempts = counts["attempts"] / max(1, counts["publishes"])
                row = rows[name]
                for key, share in (("p50", 50), ("p99", 99), ("p999", 99.9), ("max", 100)):
                    row[key].append(percentile(latencies, share) * 1e3)
                row["attempts"].append(attempts)
                p50, p99, p999 = row["p50"][-1], row["p99"][-1], row["p999"][-1]
                print(
                    f"round {round_number + 1} {name:>16}: p50 {p50:.1f} ms, p99 {p99:.1f} ms, "
                    f"p99.9 {p999:.1f} ms, {attempts:.3f} attempts/publish (load {load_average()})",
                    flush=True,
                )
        finally:
            server.stop()
    count = round(options.rate * options.seconds)
    print()
    print(
        f"latency mix {options.mix}; {count:,} publishes at {options.rate:g}/s per client per round, one "
        f"message per request, hedge delay {delay} s, 50 tokens, refill 0.1; {options.rounds} rounds "
        f"(medians [min-max]); load average {load_before} before, {load_average()} after"
    )
    print(f"{'client':>16} {'p50 ms':>20} {'p99 ms':>24} {'p99.9 ms':>26} {'max ms':>26} {'attempts':>20}")
    for name in names:
        row = rows[name]
        print(
            f"{name:>16} {spread(row['p50'], '.1f'):>20} {spread(row['p99'], '.1f'):>24} "
            f"{spread(row['p999'], '.1f'):>26} {spread(row['max'], '.0f'):>26} "
            f"{spread(row['attempts'], '.3f'):>20}"
        )
    for name in (n for n in names if n.endswith("-proxy")):
        for key, label in (("p99", "p99"), ("p999", "p99.9")):
            ratios = [a / b for a, b in zip(rows[name][key], rows["hedgepub"][key], strict=True)]
            print(f"{name} / hedgepub {label}: {spread(ratios, '.2f')}x (target <= 1.2x)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--messages", type=int, default=20_000, help="throughput: messages per run")
    parser.add_argument("--latency-publishes", type=int, default=500, help="latency: timed publishes per run")
    parser.add_argument("--requests", type=int, default=800, help="CPU per request: raw requests per run")
    parser.add_argument("--tails", action="store_true", help="the tail-latency comparison instead")
    parser.add_argument("--mix", default=REFERENCE_MIX, help="tails: the server's Publish latency mix")
    parser.add_argument("--rate", type=float, default=100.0, help="tails: publishes per second")
    parser.add_argument("--seconds", type=float, default=30.0, help="tails: seconds of publishing per run")
    parser.add_argument("--warm-up", type=int, default=100, help="tails: publishes before the timed ones")
    parser.add_argument("--hedge-delay", type=float, default=0.1, help="tails: the hedge delay (seconds)")
    parser.add_argument("--no-node", dest="node", action="store_false", help="tails: skip the Node.js client")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--topic", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.child:
        print(json.dumps(child(options)), flush=True)
        return 0
    if options.tails:
        tails(options)
    else:
        cost(options)
    return 0


if __name__ == "__main__":
    sys.exit(main())
