"""Memory per connection of a publisher's pool (``channel_pool_size``).

Each measurement runs in a fresh Python process: a ``PublisherClient`` of pool size 1 publishes once and
is shut down (imports, gRPC's threads, the loop thread: what every size pays), the resident set size is
read, then a client of the size measured publishes 200 messages one at a time, waits 1.5 s for every
connection of its pool to be up, and the resident set size is read again. The sizes take turns round after
round against one local server (in memory, in this process), and each is summed up as the median with
[min-max] of its increase; the cost of one connection is the slope between the smallest and the largest
size.

    python benchmarks/pool_memory.py [--rounds 3] [--sizes 1,2,4,8]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

TOPIC = "projects/bench-project/topics/pool-memory"


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def child(address: str, size: int) -> dict[str, int]:
    """One measurement, in this fresh process."""
    from hedgepub import PublisherClient

    baseline = PublisherClient(endpoint=address, channel_pool_size=1)
    baseline.publish(TOPIC, b"x").result(timeout=60)
    baseline.shutdown()
    gc.collect()
    before = _rss_kib()
    publisher = PublisherClient(endpoint=address, channel_pool_size=size)
    for _ in range(200):
        publisher.publish(TOPIC, b"x" * 100).result(timeout=60)
    time.sleep(1.5)
    gc.collect()
    after = _rss_kib()
    publisher.shutdown()
    return {"size": size, "kib": after - before}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", default="1,2,4,8")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.child:
        print(json.dumps(child(options.child[0], int(options.child[1]))))
        return 0
    from hedgepub.admin import AdminClient
    from hedgepub.server import LocalServer

    sizes = [int(size) for size in options.sizes.split(",")]
    load_before = os.getloadavg()
    increases: dict[int, list[int]] = {size: [] for size in sizes}
    with LocalServer(in_memory=True) as server:
        with AdminClient(server.address) as admin:
            admin.create_topic(TOPIC)
        for round_number in range(options.rounds):
            order = sizes[round_number % len(sizes) :] + sizes[: round_number % len(sizes)]
            for size in order:
                done = subprocess.run(
                    [sys.executable, os.path.abspath(__file__), "--child", server.address, str(size)],
                    capture_output=True,
                    text=True,
                    timeout=300,
                    check=True,
                )
                increases[size].append(json.loads(done.stdout.strip().splitlines()[-1])["kib"])
    load_after = os.getloadavg()
    loads = (
        " ".join(f"{value:.2f}" for value in load_before),
        " ".join(f"{value:.2f}" for value in load_after),
    )
    print(
        f"{options.rounds} rounds, each size in a fresh process; "
        f"load average {loads[0]} before, {loads[1]} after"
    )
    for size, values in increases.items():
        print(
            f"  channel_pool_size={size}: +{statistics.median(values):,.0f} KiB "
            f"[{min(values):,}-{max(values):,}] resident over a client of size 1's baseline"
        )
    low, high = min(sizes), max(sizes)
    if high > low:
        slope = (statistics.median(increases[high]) - statistics.median(increases[low])) / (high - low)
        print(f"  per connection (sizes {low} to {high}): {slope:,.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
