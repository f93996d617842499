"""Cost of the one-port front: gRPC publish throughput with REST on the same port, against gRPC alone.

With REST on (the default) the server's public port belongs to a front that relays gRPC connections to
the gRPC face listening privately; with ``rest=False`` gRPC listens on the public port itself. Each
round starts one in-memory server of each kind (in a child process, as ``publish_throughput.py``
does, so the server has its own interpreter) and publishes the same messages to it through the
concurrent raw-bytes publishers of ``server_ingest.py`` (which make the server, not the client, the
bottleneck, so any cost of the relay shows). Rounds alternate which kind goes first.

    python benchmarks/rest_front.py [--messages 100000] [--rounds 3] [--publishers 4]

Target: front on >= 0.90x gRPC alone (issue 11).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys

from google.pubsub_v1.types import pubsub as pubsub_types

from publish_throughput import local_server
from server_ingest import TOPIC, _publish_all

TARGET = 0.90
KINDS = {"grpc-alone": False, "front": True}


def measure(rest: bool, messages: int, publishers: int, batch: int, size: int) -> tuple[float, float]:
    """Messages/s and RPC p50 (ms) of a fresh server with the front on (``rest``) or off."""
    message = pubsub_types.PubsubMessage.pb()(data=b"x" * size)
    request = pubsub_types.PublishRequest.pb()(topic=TOPIC, messages=[message] * batch)
    with local_server(multiprocessing.get_context("spawn"), rest=rest) as address:
        run = asyncio.run(
            _publish_all(address, max(1, messages // batch), publishers, request.SerializeToString(), batch)
        )
    return run.messages_per_second, run.rpc_p50_ms


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the rates and the ratio; exit status 1 when the target is missed."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=100_000, help="messages per server and round")
    parser.add_argument("--publishers", type=int, default=4, help="concurrent publishers")
    parser.add_argument("--batch", type=int, default=100, help="messages per Publish RPC")
    parser.add_argument("--size", type=int, default=100, help="bytes per message")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each runs both kinds")
    options = parser.parse_args(argv)

    rates: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for round_number in range(options.rounds):
        order = list(KINDS) if round_number % 2 == 0 else list(reversed(KINDS))
        for kind in order:
            rate, p50 = measure(
                KINDS[kind], options.messages, options.publishers, options.batch, options.size
            )
            rates[kind].append(rate)
            print(
                f"round {round_number + 1} {kind:>10}: {rate:>10,.0f} msg/s  RPC p50 {p50:.1f} ms", flush=True
            )

    alone, front = (statistics.median(rates[kind]) for kind in KINDS)
    ratio = front / alone
    print()
    print(
        f"{options.messages:,} messages of {options.size} B per round, {options.batch} per Publish, "
        f"{options.publishers} publishers, {options.rounds} rounds (medians)"
    )
    print(f"gRPC alone            : {alone:>10,.0f} msg/s")
    print(f"gRPC through the front: {front:>10,.0f} msg/s")
    verdict = "ok" if ratio >= TARGET else "MISSED"
    print(f"front / alone         : {ratio:>6.2f}x  (target >= {TARGET:.2f}x)  {verdict}")
    return 0 if ratio >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
