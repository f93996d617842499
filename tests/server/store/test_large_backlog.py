"""A backlog larger than one response: the official subscriber drains it, Pull answers stay under 4 MiB.

The official clients, given ``PUBSUB_EMULATOR_HOST``, open a plain channel that refuses any response over
4 MiB; a server that packed more into one Pull or StreamingPull response stalled them for good.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from google.cloud import pubsub_v1

from hedgepub.server import LocalServer

from ..._pb import AcknowledgeRequest, PublishRequest, PubsubMessage, PullRequest, Subscription, Topic
from ..conftest import SUBSCRIPTION, TOPIC, RawClient

MESSAGES = 2000
SIZE = 5 * 1024


def _publish_backlog(raw: RawClient, count: int, size: int) -> None:
    raw.call("CreateTopic", Topic(name=TOPIC))
    raw.call("CreateSubscription", Subscription(name=SUBSCRIPTION, topic=TOPIC))
    for start in range(0, count, 500):
        messages = [
            PubsubMessage(data=f"{i:06d}".encode() + b"x" * (size - 6))
            for i in range(start, min(count, start + 500))
        ]
        raw.call("Publish", PublishRequest(topic=TOPIC, messages=messages))


def test_the_official_subscriber_drains_a_backlog_larger_than_one_response(
    server: LocalServer,
    subscriber: pubsub_v1.SubscriberClient,
    wait_for: Callable[..., bool],
) -> None:
    raw = RawClient(server.address)
    try:
        _publish_backlog(raw, MESSAGES, SIZE)  # 10 MB waiting before anyone subscribes
    finally:
        raw.close()
    lock = threading.Lock()
    received: set[bytes] = set()

    def callback(message: Any) -> None:
        with lock:
            received.add(message.data[:6])
        message.ack()

    future = subscriber.subscribe(
        SUBSCRIPTION,
        callback,
        flow_control=pubsub_v1.types.FlowControl(max_messages=MESSAGES, max_bytes=100 * 1024 * 1024),
    )
    try:
        assert wait_for(lambda: len(received) == MESSAGES, timeout=60), f"received {len(received)}"
    finally:
        future.cancel()
    assert server.wait_until_idle(timeout=10)


def test_pull_answers_stay_under_four_mebibytes(server: LocalServer) -> None:
    raw = RawClient(server.address)
    try:
        _publish_backlog(raw, MESSAGES, SIZE)
        delivered = 0
        while delivered < MESSAGES:
            response = raw.call(
                "Pull",
                PullRequest(subscription=SUBSCRIPTION, max_messages=1000, return_immediately=True),
            )
            assert 0 < response.ByteSize() < 4 * 1024 * 1024
            delivered += len(response.received_messages)
            raw.call(
                "Acknowledge",
                AcknowledgeRequest(
                    subscription=SUBSCRIPTION, ack_ids=[r.ack_id for r in response.received_messages]
                ),
            )
        assert delivered == MESSAGES
    finally:
        raw.close()
