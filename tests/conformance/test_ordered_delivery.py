"""Ordered delivery at the service's pace, through the official clients, beside Google's emulator.

A hot ordering key (300 messages on one key) and the Node.js client's own acceptance scenario (messages
over four keys, the first delivery of every 97th nacked; ``HEDGEPUB_ORDERED_MESSAGES``, 2,000 by default,
10,000 in the client's system test) drain with order never broken, on a fresh local server; where Google's
emulator is installed, the local server drains them within twice the emulator's time (medians of
interleaved rounds, after a warm-up of the emulator's JVM). The Node client opens several streams and
acks about every 100 ms, so a server that hands out one message per key per acknowledgement round trip
takes that round trip per message; the Python client queues a key's messages itself.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from google.cloud import pubsub_v1

from hedgepub.server import LocalServer

NODE_DIR = Path(__file__).parent.parent / "interop" / "node"
#: Messages of the four-key scenario (the Node client's system test publishes 10,000).
FOUR_KEY_MESSAGES = int(os.environ.get("HEDGEPUB_ORDERED_MESSAGES", "2000"))
ROUNDS = 3


def _node() -> str:
    node = shutil.which("node")
    if node is None or not (NODE_DIR / "node_modules" / "@google-cloud" / "pubsub").is_dir():
        pytest.skip("Node.js interop: node or tests/interop/node/node_modules is missing (npm install)")
    return node


def node_ordered(address: str, messages: int, keys: int, nack_every: int = 0) -> dict[str, object]:
    """Run ``ordered.mjs`` against ``address``; its summary (it fails on an order broken)."""
    env = {
        **os.environ,
        "PUBSUB_EMULATOR_HOST": address,
        "ORDERED_MESSAGES": str(messages),
        "ORDERED_KEYS": str(keys),
        "ORDERED_NACK_EVERY": str(nack_every),
        "INTEROP_TIMEOUT_MS": "240000",
    }
    result = subprocess.run(
        [_node(), "ordered.mjs"], cwd=NODE_DIR, env=env, capture_output=True, text=True, timeout=300
    )
    output = f"{result.stderr}\n{result.stdout}"
    assert result.returncode == 0, f"ordered.mjs exited {result.returncode}:\n{output[-3000:]}"
    summary: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["ok"] is True
    return summary


def python_ordered(address: str, messages: int) -> float:
    """Publish ``messages`` on one key with the official Python client and receive them through its
    streaming ``subscribe``; seconds from the first publish to the last ack. Fails on an order broken."""
    previous = os.environ.get("PUBSUB_EMULATOR_HOST")
    os.environ["PUBSUB_EMULATOR_HOST"] = address
    try:
        publisher = pubsub_v1.PublisherClient(
            publisher_options=pubsub_v1.types.PublisherOptions(enable_message_ordering=True)
        )
        subscriber = pubsub_v1.SubscriberClient()
    finally:
        if previous is None:
            del os.environ["PUBSUB_EMULATOR_HOST"]
        else:
            os.environ["PUBSUB_EMULATOR_HOST"] = previous
    stem = uuid.uuid4().hex[:10]
    topic = f"projects/ordered/topics/hot-{stem}"
    subscription = f"projects/ordered/subscriptions/hot-{stem}"
    publisher.create_topic(name=topic)
    subscriber.create_subscription(
        request={"name": subscription, "topic": topic, "enable_message_ordering": True}
    )
    received: list[int] = []
    done = threading.Event()

    def callback(message: pubsub_v1.subscriber.message.Message) -> None:
        index = int(message.attributes["index"])
        if index not in received:
            received.append(index)
        message.ack()
        if len(received) == messages:
            done.set()

    started = time.perf_counter()
    future = subscriber.subscribe(subscription, callback)
    try:
        for index in range(messages):
            publisher.publish(topic, f"{index}".encode(), ordering_key="hot", index=str(index))
        assert done.wait(120), f"received {len(received)} of {messages}"
        elapsed = time.perf_counter() - started
    finally:
        future.cancel()
        future.result(timeout=30)
        subscriber.delete_subscription(subscription=subscription)
        publisher.delete_topic(topic=topic)
        subscriber.close()
        publisher.stop()
    assert received == list(range(messages)), "the hot key's first deliveries are out of order"
    return elapsed


def node_hot_key(address: str) -> float:
    return float(node_ordered(address, 300, 1)["drainMs"]) / 1000  # type: ignore[arg-type]


def node_four_keys(address: str) -> float:
    summary = node_ordered(address, FOUR_KEY_MESSAGES, 4, nack_every=97)
    return float(summary["drainMs"]) / 1000  # type: ignore[arg-type]


def python_hot_key(address: str) -> float:
    return python_ordered(address, 300)


SCENARIOS: dict[str, Callable[[str], float]] = {
    "node-hot-key": node_hot_key,
    "node-four-keys": node_four_keys,
    "python-hot-key": python_hot_key,
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_ordered_delivery_drains_in_order_on_the_local_server(scenario: str) -> None:
    with LocalServer(host="127.0.0.1", port=0, in_memory=True) as server:
        SCENARIOS[scenario](server.address)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_ordered_delivery_drains_within_twice_the_emulators_time(scenario: str, google_emulator: str) -> None:
    run = SCENARIOS[scenario]
    run(google_emulator)  # the emulator's JVM warms up
    ours: list[float] = []
    theirs: list[float] = []
    for round_number in range(ROUNDS):  # interleaved, the order alternating, so load hurts both alike
        with LocalServer(host="127.0.0.1", port=0, in_memory=True) as server:
            pair = [(ours, server.address), (theirs, google_emulator)]
            for times, address in pair if round_number % 2 == 0 else pair[::-1]:
                times.append(run(address))
    ratio = statistics.median(ours) / statistics.median(theirs)
    print(f"{scenario}: hedgepub {ours} s, emulator {theirs} s, ratio of medians {ratio:.2f}")
    assert ratio <= 2.0, f"{scenario}: {ratio:.2f}x the emulator's time (hedgepub {ours}, emulator {theirs})"
