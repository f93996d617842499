"""The official Python and Node.js clients, unchanged, pointed at the proxy (``PUBSUB_EMULATOR_HOST``) in
front of a real local server: admin calls, publishing (hedged by the proxy), StreamingPull, acks."""

from __future__ import annotations

import threading
from typing import Any

from google.cloud import pubsub_v1

from hedgepub.proxy import Proxy
from hedgepub.server import LocalServer

from ..interop.test_node_client import PROJECT, TOPIC_ID, check_round_trip, node_path, run_interop
from .conftest import AttemptRecorder, unique


def test_the_python_client_publishes_and_streams_through_the_proxy(
    proxy: Proxy, upstream: LocalServer
) -> None:
    publisher = pubsub_v1.PublisherClient()
    subscriber = pubsub_v1.SubscriberClient()
    topic = publisher.create_topic(name=unique("topics")).name
    subscription = subscriber.create_subscription(name=unique("subscriptions"), topic=topic).name
    futures = [publisher.publish(topic, b"m%d" % i, origin="python") for i in range(20)]
    ids = [future.result(timeout=30) for future in futures]
    stored = upstream.messages(topic)
    assert sorted(m.data for m in stored) == sorted(b"m%d" % i for i in range(20))
    assert all(m.attributes == {"origin": "python"} for m in stored)

    received: dict[str, bytes] = {}
    all_in = threading.Event()

    def callback(message: Any) -> None:
        received[message.message_id] = message.data
        message.ack()
        if len(received) == len(ids):
            all_in.set()

    streaming = subscriber.subscribe(subscription, callback)  # StreamingPull, through the proxy
    try:
        assert all_in.wait(30), f"received {len(received)} of {len(ids)}"
    finally:
        streaming.cancel()
        subscriber.close()
    assert received == {message_id: b"m%d" % i for i, message_id in enumerate(ids)}
    stats = proxy.stats()
    assert stats.messages_published == 20 and stats.messages_failed == 0
    project = topic.rsplit("/topics/", 1)[0]
    assert topic in [listed.name for listed in publisher.list_topics(project=project)]
    publisher.delete_topic(topic=topic)
    assert topic not in [listed.name for listed in publisher.list_topics(project=project)]


def test_the_node_client_round_trips_through_the_proxy(
    proxy: Proxy, upstream: LocalServer, recorder: AttemptRecorder
) -> None:
    node = node_path()
    result = run_interop(node, proxy.address)
    check_round_trip(result, upstream.messages(f"projects/{PROJECT}/topics/{TOPIC_ID}"))
    stats = proxy.stats()
    assert stats.messages_published == 6  # 5 with an ordering key, then 1 without
    assert stats.unhedged_keyed_batches >= 1
    # Every keyed request reached the server once, as the original: keyed batches are never hedged.
    keyed = [attempt for attempt, keys in recorder.attempts if keys - {""}]
    assert keyed and set(keyed) == {0}
