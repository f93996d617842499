"""Ordered delivery across a SIGKILL of ``hedgepub serve`` on SQLite, through the official Python client.

Before the kill a hot key's messages are leased many at once (Pull, as the official client's low-level
``pull`` sends it), some acknowledged, one nacked (which takes the key's later outstanding messages back)
and some left outstanding; after the kill and a restart on the same data directory, the client's streaming
``subscribe`` receives every message not acknowledged, from the first of them, in order, and none that was.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from google.cloud import pubsub_v1

from ..._pb import PublishRequest, PubsubMessage, Subscription, Topic
from ..conftest import RawClient

TOPIC = "projects/ordered-restart/topics/hot"
SUBSCRIPTION = "projects/ordered-restart/subscriptions/hot-sub"
MESSAGES = 300


def test_a_hot_key_keeps_its_order_across_nacks_and_a_sigkill(hedgepub_serve: Any) -> None:
    server = hedgepub_serve()
    raw = RawClient(os.environ["PUBSUB_EMULATOR_HOST"])
    try:
        raw.call("CreateTopic", Topic(name=TOPIC))
        raw.call(
            "CreateSubscription",
            Subscription(
                name=SUBSCRIPTION, topic=TOPIC, enable_message_ordering=True, ack_deadline_seconds=600
            ),
        )
        for start in range(0, MESSAGES, 100):
            messages = [
                PubsubMessage(data=f"{i}".encode(), ordering_key="hot", attributes={"index": str(i)})
                for i in range(start, start + 100)
            ]
            raw.call("Publish", PublishRequest(topic=TOPIC, messages=messages))
    finally:
        raw.close()

    subscriber = pubsub_v1.SubscriberClient()
    try:
        first = subscriber.pull(subscription=SUBSCRIPTION, max_messages=120, timeout=30).received_messages
        second = subscriber.pull(subscription=SUBSCRIPTION, max_messages=60, timeout=30).received_messages
        leased = [int(r.message.attributes["index"]) for r in [*first, *second]]
        assert leased == list(range(180)), "several of the key at once, in order across the two Pulls"
        subscriber.acknowledge(subscription=SUBSCRIPTION, ack_ids=[r.ack_id for r in first[:50]])
        # The nack of 80 takes 81..179 back with it; the next Pull starts again at 80.
        subscriber.modify_ack_deadline(
            subscription=SUBSCRIPTION, ack_ids=[first[80].ack_id], ack_deadline_seconds=0
        )
        again = subscriber.pull(subscription=SUBSCRIPTION, max_messages=30, timeout=30).received_messages
        assert [int(r.message.attributes["index"]) for r in again] == list(range(80, 110))
    finally:
        subscriber.close()
    server.send_signal(signal.SIGKILL)
    server.wait(10)

    hedgepub_serve()
    subscriber = pubsub_v1.SubscriberClient()
    received: list[int] = []
    done = threading.Event()

    def callback(message: Any) -> None:
        received.append(int(message.attributes["index"]))
        message.ack()
        if len(received) >= MESSAGES - 50:
            done.set()

    future = subscriber.subscribe(SUBSCRIPTION, callback)
    try:
        assert done.wait(120), f"received {len(received)} of {MESSAGES - 50} after the restart"
    finally:
        future.cancel()
        future.result(timeout=30)
        subscriber.close()
    # Everything not acknowledged before the kill, from its first message on, in order, exactly once.
    assert received == list(range(50, MESSAGES))
