"""Per-subscription delivery state that outlives a restart: delivery attempts under a dead-letter policy.

The attempts test kills ``hedgepub serve`` with SIGKILL (nothing is flushed or closed) between nacks, and
checks that the count goes on where it was: seen through raw gRPC before the kill and through the
official client's ``message.delivery_attempt`` after it.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from google.cloud import pubsub_v1
from google.pubsub_v1.types import pubsub as types

from .conftest import RawClient

PROJECT = "projects/restarts"
TOPIC = f"{PROJECT}/topics/work"
SUBSCRIPTION = f"{PROJECT}/subscriptions/work-sub"
DEAD_LETTERS = f"{PROJECT}/topics/dead-letters"
DEAD_LETTER_SUBSCRIPTION = f"{PROJECT}/subscriptions/dead-letters-sub"

Topic: Any = types.Topic.pb()
Subscription: Any = types.Subscription.pb()
PubsubMessage: Any = types.PubsubMessage.pb()
PublishRequest: Any = types.PublishRequest.pb()
PullRequest: Any = types.PullRequest.pb()
ModifyAckDeadlineRequest: Any = types.ModifyAckDeadlineRequest.pb()


def server_address() -> str:
    """Where ``hedgepub_serve`` put the server (it sets PUBSUB_EMULATOR_HOST)."""
    return os.environ["PUBSUB_EMULATOR_HOST"]


def _pull_one(raw: RawClient, subscription: str) -> Any:
    (received,) = raw.call(
        "Pull", PullRequest(subscription=subscription, max_messages=1), timeout=20
    ).received_messages
    return received


def test_delivery_attempts_go_on_after_a_sigkill(hedgepub_serve: Any) -> None:
    server = hedgepub_serve()
    raw = RawClient(server_address())
    try:
        raw.call("CreateTopic", Topic(name=TOPIC))
        raw.call("CreateTopic", Topic(name=DEAD_LETTERS))
        raw.call("CreateSubscription", Subscription(name=DEAD_LETTER_SUBSCRIPTION, topic=DEAD_LETTERS))
        config = Subscription(name=SUBSCRIPTION, topic=TOPIC, ack_deadline_seconds=60)
        config.dead_letter_policy.dead_letter_topic = DEAD_LETTERS
        config.dead_letter_policy.max_delivery_attempts = 5
        raw.call("CreateSubscription", config)
        raw.call("Publish", PublishRequest(topic=TOPIC, messages=[PubsubMessage(data=b"poison")]))
        for attempt in (1, 2, 3):
            received = _pull_one(raw, SUBSCRIPTION)
            assert received.delivery_attempt == attempt
            # Answered once the count is in the store.
            raw.call(
                "ModifyAckDeadline",
                ModifyAckDeadlineRequest(
                    subscription=SUBSCRIPTION, ack_ids=[received.ack_id], ack_deadline_seconds=0
                ),
            )
    finally:
        raw.close()
    server.send_signal(signal.SIGKILL)
    server.wait(10)

    hedgepub_serve()
    # The official client (streaming pull, nacks by ModifyAckDeadline) sees the count go on: 4, then 5,
    # and the fifth nack sends the message to the dead-letter topic.
    subscriber = pubsub_v1.SubscriberClient()
    seen: list[int | None] = []
    both = threading.Event()

    def nack(message: Any) -> None:
        seen.append(message.delivery_attempt)
        message.nack()
        if len(seen) == 2:
            both.set()

    streaming = subscriber.subscribe(SUBSCRIPTION, nack)
    try:
        assert both.wait(30), seen
    finally:
        streaming.cancel()
        streaming.result(timeout=10)
        subscriber.close()
    assert seen == [4, 5]
    raw = RawClient(server_address())
    try:
        forwarded = _pull_one(raw, DEAD_LETTER_SUBSCRIPTION)
        assert forwarded.message.data == b"poison"
        assert forwarded.message.attributes["CloudPubSubDeadLetterSourceDeliveryCount"] == "5"
        empty = raw.call(
            "Pull", PullRequest(subscription=SUBSCRIPTION, max_messages=1, return_immediately=True)
        )
        assert list(empty.received_messages) == []
    finally:
        raw.close()
