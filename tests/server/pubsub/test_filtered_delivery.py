"""Filtered subscriptions with the official client, on both stores: only matching messages are delivered,
the others are acknowledged for that subscription at publish time, and the filter survives a restart."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from google.cloud import pubsub_v1

from hedgepub.server import LocalServer

PROJECT = "projects/test-project"
TOPIC = f"{PROJECT}/topics/news"
EUROPE = f"{PROJECT}/subscriptions/europe"
EVERYTHING = f"{PROJECT}/subscriptions/everything"
FILTER = 'attributes.region = "eu" AND NOT hasPrefix(attributes.kind, "draft")'


def _publish_news(publisher: pubsub_v1.PublisherClient) -> None:
    futures = [
        publisher.publish(TOPIC, b"eu-1", region="eu", kind="story"),
        publisher.publish(TOPIC, b"us-1", region="us", kind="story"),
        publisher.publish(TOPIC, b"eu-draft", region="eu", kind="draft-2"),
        publisher.publish(TOPIC, b"none"),
        publisher.publish(TOPIC, b"eu-2", region="eu"),
    ]
    for future in futures:
        future.result(timeout=10)


def test_a_filtered_subscribe_receives_only_matching_messages(
    server: LocalServer,
    publisher: pubsub_v1.PublisherClient,
    subscriber: pubsub_v1.SubscriberClient,
    wait_for: Callable[..., bool],
) -> None:
    publisher.create_topic(name=TOPIC)
    created = subscriber.create_subscription(request={"name": EUROPE, "topic": TOPIC, "filter": FILTER})
    assert created.filter == FILTER
    subscriber.create_subscription(name=EVERYTHING, topic=TOPIC)
    _publish_news(publisher)

    received: list[bytes] = []
    lock = threading.Lock()

    def callback(message: Any) -> None:
        with lock:
            received.append(message.data)
        message.ack()

    future = subscriber.subscribe(EUROPE, callback)
    try:
        assert wait_for(lambda: len(received) >= 2)
        # The three others were acknowledged for this subscription when published: once the two are
        # acknowledged, nothing is left on it, while the unfiltered subscription still holds all five.
        pulled = subscriber.pull(subscription=EVERYTHING, max_messages=10, timeout=10)
        assert len(pulled.received_messages) == 5
        subscriber.acknowledge(subscription=EVERYTHING, ack_ids=[m.ack_id for m in pulled.received_messages])
        assert server.wait_until_idle(timeout=10)
    finally:
        future.cancel()
        future.result(timeout=10)
    assert sorted(received) == [b"eu-1", b"eu-2"]


def _pull_data(subscriber: pubsub_v1.SubscriberClient, subscription: str) -> list[bytes]:
    response = subscriber.pull(subscription=subscription, max_messages=10, timeout=10)
    return sorted(received.message.data for received in response.received_messages)


def test_the_filter_holds_after_a_restart(tmp_path: Path, monkeypatch: Any) -> None:
    data = tmp_path / "data"
    with LocalServer(data_dir=data) as first:
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", first.address)
        publisher = pubsub_v1.PublisherClient()
        subscriber = pubsub_v1.SubscriberClient()
        publisher.create_topic(name=TOPIC)
        subscriber.create_subscription(request={"name": EUROPE, "topic": TOPIC, "filter": FILTER})
        _publish_news(publisher)
        publisher.stop()
        subscriber.close()
    with LocalServer(data_dir=data) as second:
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", second.address)
        publisher = pubsub_v1.PublisherClient()
        subscriber = pubsub_v1.SubscriberClient()
        try:
            assert subscriber.get_subscription(subscription=EUROPE).filter == FILTER
            publisher.publish(TOPIC, b"eu-3", region="eu").result(timeout=10)
            publisher.publish(TOPIC, b"us-2", region="us").result(timeout=10)
            assert _pull_data(subscriber, EUROPE) == [b"eu-1", b"eu-2", b"eu-3"]
        finally:
            publisher.stop()
            subscriber.close()
