"""A push subscription loses nothing when its endpoint fails for a while and the server is SIGKILLed.

``hedgepub serve`` runs as a subprocess on SQLite; the push endpoint is a real HTTP server on 127.0.0.1
started by the test. Messages are published through the official client; the endpoint acknowledges
(200) a first part of them, then refuses everything (500); while it refuses, the server is killed with
SIGKILL and restarted on the same data directory and port; the endpoint keeps refusing for a few more
deliveries, then acknowledges again. Every message must in the end have been acknowledged by the
endpoint at least once (duplicates are allowed: delivery is at-least-once).

Settings (environment): ``HEDGEPUB_TRUST_PUSH_MESSAGES`` (default 1000).
"""

from __future__ import annotations

import base64
import json
import os
from typing import Any

import pytest
from google.cloud import pubsub_v1

pytestmark = pytest.mark.skipif(os.name != "posix", reason="kills the server process with SIGKILL")

MESSAGES = int(os.environ.get("HEDGEPUB_TRUST_PUSH_MESSAGES", "") or 1000)
TOPIC = "projects/push-trust/topics/orders"
SUBSCRIPTION = "projects/push-trust/subscriptions/orders-push"


def _acknowledged(requests: list[Any]) -> set[bytes]:
    """The message data the endpoint acknowledged (answered 200 to)."""
    return {
        base64.b64decode(json.loads(request.body)["message"].get("data", ""))
        for request in requests
        if request.status == 200
    }


def test_push_survives_a_failing_endpoint_and_a_sigkill(
    server_process: Any, push_endpoint: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    server_process.start()
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", server_process.address)
    publisher = pubsub_v1.PublisherClient()
    subscriber = pubsub_v1.SubscriberClient()
    publisher.create_topic(name=TOPIC)
    subscriber.create_subscription(
        request={"name": SUBSCRIPTION, "topic": TOPIC, "push_config": {"push_endpoint": push_endpoint.url}}
    )
    expected = {f"order {i:05d}".encode() for i in range(MESSAGES)}
    futures = [publisher.publish(TOPIC, data) for data in sorted(expected)]
    for future in futures:
        future.result(timeout=60)

    # A first part is acknowledged, then the endpoint refuses everything.
    assert push_endpoint.wait_for(lambda requests: len(_acknowledged(requests)) >= MESSAGES // 4, 60)
    push_endpoint.status = 500
    refused_before = sum(request.status == 500 for request in push_endpoint.requests)
    assert push_endpoint.wait_for(
        lambda requests: sum(request.status == 500 for request in requests) >= refused_before + 5, 60
    )
    server_process.kill()
    server_process.start()
    # The restarted server pushes again (from what it stored) to an endpoint that still refuses.
    refused_before = sum(request.status == 500 for request in push_endpoint.requests)
    assert push_endpoint.wait_for(
        lambda requests: sum(request.status == 500 for request in requests) >= refused_before + 3, 60
    )
    push_endpoint.status = 200
    assert push_endpoint.wait_for(lambda requests: _acknowledged(requests) >= expected, 90), (
        f"{len(expected - _acknowledged(push_endpoint.requests))} of {MESSAGES} never acknowledged"
    )
    requests = push_endpoint.requests
    assert _acknowledged(requests) == expected
    answered = sum(request.status == 200 for request in requests)
    print(
        f"push: {MESSAGES} messages, {len(requests)} requests, {answered} acknowledged "
        f"({answered - MESSAGES} duplicates), {len(requests) - answered} refused"
    )
    publisher.stop()
    subscriber.close()
