"""Publish tails from the network: packet loss, a black-holed connection and SYN loss, hedged or not.

1 KiB single-message publishes at a fixed rate to ``hedgepub serve --in-memory --no-rest``, through the
userspace relay (:class:`hedgepub.testing.FaultRelay`, the default) or, with ``--kernel`` (root, Linux),
in a network namespace whose loopback loses packets by iptables (:mod:`hedgepub.testing.network.kernel`).
Three publishers are compared, each run in a fresh process, in interleaved rounds (the order shuffled
per round):

- ``unhedged``: one connection, no hedging;
- ``same-conn``: one connection, hedging after ``--hedge-delay`` (today's hedges ride the same TCP
  connection as the original);
- ``other-conn``: hedges on another connection: ``channel_pool_size=2`` where the client accepts it, else
  ``hedge_endpoints`` naming the same server under another address (a second TCP connection).

Faults (``--fault``, repeatable): ``loss:P`` (each packet or segment lost with probability P, both ways,
from the start), ``blackhole:S`` (the connection carrying the originals black-holed for S seconds, a
quarter of the way into the measured period: the busiest one, by bytes sent, since the sockets' order
does not say which connection of the pool is which) and ``syn:P`` (connection-opening packets lost with
probability P, from the start; no warm-up, so the first publishes need a connection).

Each run warms up first (unless ``syn``): 500 publishes, which fill the token bucket (50 tokens, 0.1 per
success) and connect. Printed: per fault and publisher, the median [min-max] over rounds of p50, p99,
p99.9 and max (ms) and of attempts per publish; per round, the hedges sent (won), the publishes slower
than 1.3x the hedge delay, and how late the measuring process's event loop ran a 5 ms timer (p99 and max
ms: the process's own stalls, which no hedge escapes); and the load average.

    python benchmarks/network_tails.py                         # relay, 2% loss and a 5 s black hole
    python benchmarks/network_tails.py --kernel --rounds 3 --fault loss:0.005 --fault loss:0.01 \\
        --fault loss:0.02 --fault blackhole:5 --fault syn:0.5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import os
import random
import statistics
import subprocess
import sys
import threading
from typing import Any

PUBLISHERS = ("unhedged", "same-conn", "other-conn")
TOPIC = "projects/network-tails/topics/tails"
WARMUP = 500


def _pool_supported() -> bool:
    from hedgepub import AsyncPublisherClient

    return "channel_pool_size" in inspect.signature(AsyncPublisherClient).parameters


def _percentile(sorted_values: list[float], fraction: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(fraction * len(sorted_values)) - 1))
    return sorted_values[index]


async def _measure(arguments: argparse.Namespace) -> dict[str, Any]:
    """One publisher, one fault, in this process: what the parent prints a line of."""
    from hedgepub import AsyncPublisherClient, BatchSettings, HedgingSettings
    from hedgepub.admin import AdminClient
    from hedgepub.testing import FaultRelay

    kind, _, value = arguments.fault.partition(":")
    amount = float(value)
    relays: list[Any] = []
    endpoint = arguments.server
    hedge_endpoint = arguments.server_alias
    if not arguments.kernel:
        syn = amount if kind == "syn" else 0.0  # from the first connection on
        relay = FaultRelay(upstream=arguments.server, seed=arguments.seed, syn_delay_probability=syn).start()
        relays.append(relay)
        endpoint = relay.address
        second = FaultRelay(
            upstream=arguments.server, seed=arguments.seed + 1, syn_delay_probability=syn
        ).start()
        relays.append(second)
        hedge_endpoint = second.address
    options: dict[str, Any] = {"batch_settings": BatchSettings(max_messages=1), "endpoint": endpoint}
    pool = _pool_supported()
    if pool:
        options["channel_pool_size"] = 2 if arguments.publisher == "other-conn" else 1
    elif arguments.publisher == "other-conn":
        options["hedge_endpoints"] = [hedge_endpoint]
    if arguments.publisher != "unhedged":
        options["hedging_settings"] = HedgingSettings(hedge_delay=arguments.hedge_delay)
    with AdminClient(arguments.server if not arguments.kernel else endpoint) as admin:
        admin.wait_ready(30.0)
        with contextlib.suppress(Exception):  # made by an earlier run on the same server
            admin.create_topic(TOPIC)
    payload = os.urandom(1024)
    client = AsyncPublisherClient(**options)
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    try:
        if kind != "syn":
            for start in range(0, WARMUP, 50):
                await asyncio.gather(*(client.publish(TOPIC, payload) for _ in range(start, start + 50)))
        if kind == "loss":
            for relay in relays:
                relay.set_loss(amount)
        before = client.stats()
        print("measuring", flush=True)  # the kernel mode's parent black-holes from here
        if kind == "blackhole" and relays:
            delay = arguments.count / arguments.rate / 4

            def hole() -> None:  # the busiest connection: the one the originals ride
                live = [info for info in relays[0].connections if not info.closed]
                if live:
                    relays[0].blackhole(amount, connections=max(live, key=lambda i: i.bytes_up).index)

            loop.call_later(delay, hole)

        async def one() -> None:
            started = loop.time()
            await client.publish(TOPIC, payload)
            latencies.append((loop.time() - started) * 1000.0)

        lags: list[float] = []

        async def watch_loop() -> None:  # how late the loop runs a 5 ms timer: the process's own stalls
            while True:
                asked = loop.time()
                await asyncio.sleep(0.005)
                lags.append((loop.time() - asked - 0.005) * 1000.0)

        watcher = asyncio.ensure_future(watch_loop())
        tasks = []
        begin = loop.time()
        for index in range(arguments.count):
            pause = begin + index / arguments.rate - loop.time()
            if pause > 0:
                await asyncio.sleep(pause)
            tasks.append(asyncio.ensure_future(one()))
        await asyncio.gather(*tasks)
        watcher.cancel()
        after = client.stats()
    finally:
        await client.shutdown(timeout=60)
        for relay in relays:
            relay.close()
    ordered = sorted(latencies)
    published = after.messages_published - before.messages_published
    return {
        "p50": _percentile(ordered, 0.5),
        "p99": _percentile(ordered, 0.99),
        "p99.9": _percentile(ordered, 0.999),
        "max": ordered[-1],
        "attempts": (after.attempts_sent - before.attempts_sent) / max(1, published),
        "pool": pool,
        "hedges": after.hedges_sent - before.hedges_sent,
        "won": after.hedges_won - before.hedges_won,
        "slow": sum(latency > 1.3 * arguments.hedge_delay * 1000.0 for latency in latencies),
        "lag_p99": _percentile(sorted(lags), 0.99) if lags else 0.0,
        "lag_max": max(lags, default=0.0),
    }


def _inner_command(
    arguments: argparse.Namespace, publisher: str, fault: str, server: str, alias: str
) -> list[str]:
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--inside",
        "--publisher",
        publisher,
        "--fault",
        fault,
    ]
    command += ["--server", server, "--server-alias", alias, "--count", str(arguments.count)]
    command += ["--rate", str(arguments.rate), "--hedge-delay", str(arguments.hedge_delay)]
    command += ["--seed", str(arguments.seed)]
    return command + (["--kernel"] if arguments.kernel else [])


def _run_one(arguments: argparse.Namespace, network: Any, publisher: str, fault: str, server: str) -> dict:
    port = int(server.rsplit(":", 1)[1])
    kind, _, value = fault.partition(":")
    alias = f"localhost:{port}"
    command = _inner_command(arguments, publisher, fault, server, alias)
    if network is None:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    else:
        if kind == "loss":
            network.set_loss(float(value), port=port)
        elif kind == "syn":
            network.set_syn_loss(float(value), port=port)
        process = network.popen(command, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    timers = []
    for line in process.stdout:
        if line.strip() == "measuring":
            if network is not None and kind == "blackhole":

                def hole() -> None:  # the connection the originals ride: the busiest, whatever its age
                    busiest = network.busiest_client_port(port)
                    if busiest is not None:
                        network.blackhole(busiest, seconds=float(value))

                timer = threading.Timer(arguments.count / arguments.rate / 4, hole)
                timer.start()
                timers.append(timer)
            continue
        result = json.loads(line)
    process.wait()
    for timer in timers:
        timer.join()
    if network is not None:
        network.set_loss(0.0, port=port)
        network.set_syn_loss(0.0, port=port)
    return result


def _span(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fault", action="append", help="loss:P, blackhole:SECONDS or syn:P (repeatable)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--count", type=int, default=1000, help="measured publishes per run")
    parser.add_argument("--rate", type=float, default=100.0, help="publishes per second (50-200)")
    parser.add_argument("--hedge-delay", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--kernel", action="store_true", help="the kernel harness (root) instead of the relay"
    )
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--publisher", choices=PUBLISHERS, help=argparse.SUPPRESS)
    parser.add_argument("--server", help=argparse.SUPPRESS)
    parser.add_argument("--server-alias", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    faults = arguments.fault or ["loss:0.02", "blackhole:5"]
    if arguments.inside:
        arguments.fault = faults[0]
        print(json.dumps(asyncio.run(_measure(arguments))), flush=True)
        return
    results: dict[tuple[str, str], list[dict]] = {}
    network = None
    serve = [sys.executable, "-m", "hedgepub", "serve", "--in-memory", "--no-rest", "--port", "0"]
    server_process = None
    try:
        if arguments.kernel:
            from hedgepub.testing.network.kernel import KernelNetwork, default_label

            network = KernelNetwork(f"{default_label()}-bench").start()
            server = network.serve()
        else:
            server_process = subprocess.Popen(serve, stdout=subprocess.PIPE, text=True)
            assert server_process.stdout is not None
            server = server_process.stdout.readline().strip().split("=", 1)[1]
        rng = random.Random(arguments.seed)
        for round_number in range(arguments.rounds):
            for fault in faults:
                order = list(PUBLISHERS)
                rng.shuffle(order)
                for publisher in order:
                    result = _run_one(arguments, network, publisher, fault, server)
                    results.setdefault((fault, publisher), []).append(result)
                    print(
                        f"round {round_number + 1} {fault} {publisher}: {json.dumps(result)}", file=sys.stderr
                    )
    finally:
        if network is not None:
            network.close()
        if server_process is not None:
            server_process.terminate()
            server_process.wait(10)
    pool = next(iter(results.values()))[0]["pool"]
    print(
        f"# {'kernel harness' if arguments.kernel else 'relay'}; {arguments.count} publishes of 1 KiB at "
        f"{arguments.rate:g}/s per run, {arguments.rounds} rounds, "
        f"hedge delay {arguments.hedge_delay * 1000:g} ms; "
        f"other-conn = {'channel_pool_size=2' if pool else 'hedge_endpoints under another name'}"
    )
    print(
        "| fault | publisher | p50 ms | p99 ms | p99.9 ms | max ms | attempts/publish | hedges (won) "
        "| publishes > 1.3x delay | loop lag p99 / max ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (fault, publisher), runs in results.items():
        cells = [_span([run[key] for run in runs]) for key in ("p50", "p99", "p99.9", "max")]
        attempts = [run["attempts"] for run in runs]
        attempt_cell = f"{statistics.median(attempts):.3f} [{min(attempts):.3f}-{max(attempts):.3f}]"
        hedges = ", ".join(f"{run.get('hedges', 0)} ({run.get('won', 0)})" for run in runs)
        slow = ", ".join(str(run.get("slow", "?")) for run in runs)
        lag = ", ".join(f"{run.get('lag_p99', 0):.0f}/{run.get('lag_max', 0):.0f}" for run in runs)
        print(f"| {fault} | {publisher} | {' | '.join(cells)} | {attempt_cell} | {hedges} | {slow} | {lag} |")
    print(
        f"load average at the end: {' '.join(f'{value:.2f}' for value in os.getloadavg())} "
        f"on {os.cpu_count()} CPUs"
    )


if __name__ == "__main__":
    main()
