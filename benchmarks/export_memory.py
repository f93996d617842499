"""Resident memory of ``hedgepub serve`` (SQLite) holding large messages for one subscription.

Starts ``hedgepub serve`` on a free port with a data directory and a buckets directory of its own,
creates a topic and one subscription, publishes ``--count`` messages of ``--size`` bytes with the
official client and, once the subscription holds them all, prints the server's ``VmRSS`` and ``VmHWM``
(``/proc/PID/status``) before and after, and the load average. ``--kind storage`` is a Cloud Storage
subscription whose file stays open (``max_bytes`` 10 GiB, ``max_duration`` 10 minutes): it holds them all
once the open file does. ``--kind pull`` is a pull subscription nobody pulls. Linux only (``/proc``).

    python benchmarks/export_memory.py --kind storage --count 60 --size 9900000
    python benchmarks/export_memory.py --kind pull --count 60 --size 9900000
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _memory(pid: int) -> str:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) // 1024
    return f"VmRSS {fields['VmRSS']} MiB, VmHWM {fields['VmHWM']} MiB"


def main() -> None:
    """Run one measurement and print it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--kind", choices=["storage", "pull"], default="storage")
    parser.add_argument("--count", type=int, default=60)
    parser.add_argument("--size", type=int, default=9_900_000)
    options = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hedgepub-export-memory-"))
    command = [sys.executable, "-m", "hedgepub", "serve", "--port", "0", "--data-dir", str(work / "data")]
    command.extend(["--buckets-dir", str(work / "buckets")])
    server = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert server.stdout is not None
        for line in server.stdout:
            found = re.search(r"127\.0\.0\.1:\d+", line)
            if found:
                os.environ["PUBSUB_EMULATOR_HOST"] = found.group(0)
                break
        from google.cloud import pubsub_v1

        publisher, subscriber = pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
        topic, name = "projects/memory-project/topics/big", "projects/memory-project/subscriptions/big"
        publisher.create_topic(name=topic)
        request: dict[str, object] = {"name": name, "topic": topic}
        if options.kind == "storage":
            request["cloud_storage_config"] = {
                "bucket": "big",
                "max_bytes": 10 * 1024**3,
                "max_duration": {"seconds": 600},
                "text_config": {},
            }
        subscriber.create_subscription(request=request)
        print(f"before: {_memory(server.pid)}")
        for number in range(options.count):
            publisher.publish(topic, bytes([65 + number % 26]) * options.size).result(60)
        partial = work / "buckets" / "big" / ".hedgepub-partial"
        if options.kind == "storage":  # wait until the open file holds every message
            while sum(path.stat().st_size for path in partial.glob("*")) < options.count * (options.size + 1):
                time.sleep(0.5)
        print(f"after {options.count} x {options.size} B ({options.kind}): {_memory(server.pid)}")
        print(f"load average: {' '.join(f'{load:.2f}' for load in os.getloadavg())}")
        subscriber.close()
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
