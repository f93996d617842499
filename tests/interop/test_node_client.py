"""The official Node.js client (``@google-cloud/pubsub``) works against the local server unchanged.

``node/interop.mjs`` drives the client (topics, an ordered subscription, publish with attributes and an
ordering key, streaming receive, ack, nack and redelivery, deletes); this test starts the server, runs the
script against it and checks both the script's summary and what the server stored. It is skipped only
where Node.js or the script's dependencies (``npm install`` in ``tests/interop/node``) are missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from hedgepub.server import LocalServer

NODE_DIR = Path(__file__).parent / "node"
CLIENT_PACKAGE = NODE_DIR / "node_modules" / "@google-cloud" / "pubsub"
PROJECT = "node-interop"
TOPIC_ID = "orders"
SUBSCRIPTION_ID = "orders-ordered"
WITNESS_ID = "orders-witness"
ORDERED_MESSAGES = 5


def node_path() -> str:
    """The ``node`` to run the scripts with; skips the test where Node.js or the client is missing."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("Node.js interop: `node` is not on PATH")
    if not CLIENT_PACKAGE.is_dir():
        pytest.skip(
            "Node.js interop: tests/interop/node/node_modules is missing "
            "(run `npm install` in tests/interop/node)"
        )
    return node


def run_interop(node: str, address: str) -> subprocess.CompletedProcess[str]:
    """Run ``node/interop.mjs`` against the Pub/Sub endpoint at ``address`` (``PUBSUB_EMULATOR_HOST``)."""
    env = {
        **os.environ,
        "PUBSUB_EMULATOR_HOST": address,
        "INTEROP_PROJECT": PROJECT,
        "INTEROP_TOPIC": TOPIC_ID,
        "INTEROP_SUBSCRIPTION": SUBSCRIPTION_ID,
        # Never pulled: it keeps every message on the server for the comparison below.
        "INTEROP_WITNESS_SUBSCRIPTION": WITNESS_ID,
        "INTEROP_MESSAGES": str(ORDERED_MESSAGES),
        # The script's own deadline comes first, so a hang ends with its message, not a kill.
        "INTEROP_TIMEOUT_MS": "45000",
    }
    return subprocess.run(
        [node, "interop.mjs"], cwd=NODE_DIR, env=env, capture_output=True, text=True, timeout=60, check=False
    )


def check_round_trip(result: subprocess.CompletedProcess[str], stored: list[Any]) -> None:
    """The script's summary and the messages the server stored (``server.messages(topic)``) show a full
    round trip: topics, ordered delivery, attributes, nack and redelivery, deletes."""
    topic = f"projects/{PROJECT}/topics/{TOPIC_ID}"
    output = f"{result.stderr}\n{result.stdout}"
    assert result.returncode == 0, f"interop.mjs exited {result.returncode}:\n{output}"
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["ok"] is True
    assert summary["client"] == "@google-cloud/pubsub"
    assert summary["topic"] == topic
    assert summary["subscription"] == f"projects/{PROJECT}/subscriptions/{SUBSCRIPTION_ID}"
    assert summary["deleted"] is True

    published = summary["published"]
    assert len(published) == ORDERED_MESSAGES + 1
    received = summary["received"]
    assert [message["id"] for message in received] == published[:ORDERED_MESSAGES]
    assert [message["data"] for message in received] == [f"ordered-{i}" for i in range(ORDERED_MESSAGES)]
    assert all(message["orderingKey"] == "interop-key" for message in received)
    assert summary["nack"] == {"id": published[-1], "deliveries": 2}

    # What the server kept for the witness subscription, in publish order, is exactly what the Node
    # client sent.
    assert [message.message_id for message in stored] == published
    assert [message.data for message in stored] == [
        *(f"ordered-{i}".encode() for i in range(ORDERED_MESSAGES)),
        b"nack-me",
    ]
    assert [message.attributes for message in stored] == [
        *({"kind": "ordered", "seq": str(i), "origin": "node"} for i in range(ORDERED_MESSAGES)),
        {"kind": "nack", "origin": "node"},
    ]
    assert [message.ordering_key for message in stored] == ["interop-key"] * ORDERED_MESSAGES + [""]
    assert all(message.topic == topic for message in stored)


def test_official_node_client_round_trip() -> None:
    node = node_path()
    with LocalServer(host="127.0.0.1", port=0, in_memory=True) as server:
        result = run_interop(node, server.address)
        stored = server.messages(f"projects/{PROJECT}/topics/{TOPIC_ID}")
    check_round_trip(result, stored)
