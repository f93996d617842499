"""Publish latency while the access token is refreshed, against a token endpoint that takes 1 s.

1 KiB single-message publishes at a fixed rate over plain text to ``hedgepub serve --in-memory --no-rest``
(a server in a process of its own), with OAuth user credentials whose token comes from a real HTTP token
endpoint on loopback that answers each refresh after ``--refresh-seconds`` (1 s). Two publishers, each
run in a fresh process, in interleaved rounds (the order shuffled per round):

- ``static``: a token valid for an hour: nothing is refreshed during the run;
- ``refreshing``: tokens that google-auth considers due a few seconds after they arrive (``expires_in``
  just above its 3 min 45 s refresh threshold), so the publisher refreshes one in the background every
  few seconds while publishes go on.

Printed: per publisher, the median [min-max] over rounds of p50, p99, p99.9 and max (ms), and of the
refreshes made during the measured period, and the load average before and after.

    python benchmarks/token_refresh.py --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import http.server
import json
import os
import random
import statistics
import subprocess
import sys
import threading
from typing import Any

PUBLISHERS = ("static", "refreshing")
TOPIC = "projects/token-refresh/topics/tails"
WARMUP = 300
#: google-auth refreshes a token this long before its expiry (``google.auth._helpers.REFRESH_THRESHOLD``).
THRESHOLD = 225.0


class SlowTokenEndpoint:
    """An OAuth token endpoint on loopback that answers each refresh after ``delay`` seconds."""

    def __init__(self, delay: float, expires_in: float) -> None:
        self.refreshes = 0
        endpoint = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                endpoint.refreshes += 1
                threading.Event().wait(delay)
                body = json.dumps(
                    {"access_token": f"t-{endpoint.refreshes}", "expires_in": expires_in}
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.uri = f"http://127.0.0.1:{self._server.server_address[1]}/token"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _percentile(sorted_values: list[float], fraction: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(fraction * len(sorted_values)) - 1))
    return sorted_values[index]


async def _measure(arguments: argparse.Namespace) -> dict[str, Any]:
    import google.oauth2.credentials
    from google.auth import _helpers

    from hedgepub import AsyncPublisherClient, BatchSettings

    # refreshing: due (for google-auth) --token-life seconds after it arrives, not yet expired for the server
    expires_in = THRESHOLD + arguments.token_life if arguments.publisher == "refreshing" else 3600.0
    endpoint = SlowTokenEndpoint(arguments.refresh_seconds, expires_in)
    credentials = google.oauth2.credentials.Credentials(
        "t-0",
        refresh_token="refresh",
        token_uri=endpoint.uri,
        client_id="client",
        client_secret="secret",
        expiry=_helpers.utcnow() + datetime.timedelta(seconds=expires_in),
    )
    client = AsyncPublisherClient(
        endpoint=f"http://{arguments.server}",
        credentials=credentials,
        batch_settings=BatchSettings(max_messages=1),
    )
    payload = os.urandom(1024)
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    try:
        for start in range(0, WARMUP, 50):
            await asyncio.gather(*(client.publish(TOPIC, payload) for _ in range(start, start + 50)))
        before = endpoint.refreshes

        async def one() -> None:
            started = loop.time()
            await client.publish(TOPIC, payload)
            latencies.append((loop.time() - started) * 1000.0)

        tasks = []
        begin = loop.time()
        for index in range(arguments.count):
            pause = begin + index / arguments.rate - loop.time()
            if pause > 0:
                await asyncio.sleep(pause)
            tasks.append(asyncio.ensure_future(one()))
        await asyncio.gather(*tasks)
        refreshes = endpoint.refreshes - before
    finally:
        await client.shutdown(timeout=60)
        endpoint.close()
    ordered = sorted(latencies)
    return {
        "p50": _percentile(ordered, 0.5),
        "p99": _percentile(ordered, 0.99),
        "p99.9": _percentile(ordered, 0.999),
        "max": ordered[-1],
        "refreshes": refreshes,
    }


def _span(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--count", type=int, default=3000, help="measured publishes per run")
    parser.add_argument("--rate", type=float, default=100.0, help="publishes per second")
    parser.add_argument("--refresh-seconds", type=float, default=1.0, help="the token endpoint's delay")
    parser.add_argument(
        "--token-life", type=float, default=4.0, help="refreshing: seconds a token is used before its refresh"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--publisher", choices=PUBLISHERS, help=argparse.SUPPRESS)
    parser.add_argument("--server", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.inside:
        print(json.dumps(asyncio.run(_measure(arguments))), flush=True)
        return
    load_before = os.getloadavg()
    serve = [sys.executable, "-m", "hedgepub", "serve", "--in-memory", "--no-rest", "--port", "0"]
    server_process = subprocess.Popen(serve, stdout=subprocess.PIPE, text=True)
    results: dict[str, list[dict[str, Any]]] = {}
    try:
        assert server_process.stdout is not None
        server = server_process.stdout.readline().strip().split("=", 1)[1]
        from hedgepub.admin import AdminClient

        with AdminClient(server) as admin:
            admin.wait_ready(30.0)
            admin.create_topic(TOPIC)
        rng = random.Random(arguments.seed)
        for round_number in range(arguments.rounds):
            order = list(PUBLISHERS)
            rng.shuffle(order)
            for publisher in order:
                command = [sys.executable, os.path.abspath(__file__), "--inside", "--publisher", publisher]
                command += ["--server", server, "--count", str(arguments.count)]
                command += ["--rate", str(arguments.rate)]
                command += ["--refresh-seconds", str(arguments.refresh_seconds)]
                command += ["--token-life", str(arguments.token_life)]
                completed = subprocess.run(command, capture_output=True, text=True, check=True)
                result = json.loads(completed.stdout.strip().splitlines()[-1])
                results.setdefault(publisher, []).append(result)
                print(f"round {round_number + 1} {publisher}: {json.dumps(result)}", file=sys.stderr)
    finally:
        server_process.terminate()
        server_process.wait(10)
    print(
        f"# {arguments.count} publishes of 1 KiB at {arguments.rate:g}/s per run, {arguments.rounds} rounds; "
        f"token endpoint {arguments.refresh_seconds:g} s; refreshing: a token due {arguments.token_life:g} s "
        "after it arrives"
    )
    print("| publisher | p50 ms | p99 ms | p99.9 ms | max ms | refreshes |")
    print("|---|---|---|---|---|---|")
    for publisher, runs in results.items():
        cells = [_span([run[key] for run in runs]) for key in ("p50", "p99", "p99.9", "max", "refreshes")]
        print(f"| {publisher} | {' | '.join(cells)} |")
    load_after = os.getloadavg()
    print(
        f"load average before {' '.join(f'{v:.2f}' for v in load_before)}, after "
        f"{' '.join(f'{v:.2f}' for v in load_after)} on {os.cpu_count()} CPUs"
    )


if __name__ == "__main__":
    main()
