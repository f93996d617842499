"""Replay with the official client on both stores: snapshots, Seek to a time and to a snapshot, retained
acknowledged messages, topic retention; errors as the real service's; durable over a SIGKILL of
``hedgepub serve``. Expiry and retention timers run on virtual time in test_replay_timers.py."""

from __future__ import annotations

import datetime
import queue
import signal
from typing import Any

import pytest
from google.api_core import exceptions
from google.cloud import pubsub_v1
from google.protobuf import field_mask_pb2, timestamp_pb2

from hedgepub.server import LocalServer

# drain() asks for an immediate answer on purpose; the official client warns that the flag is deprecated.
pytestmark = pytest.mark.filterwarnings("ignore:The return_immediately flag is deprecated:DeprecationWarning")

PROJECT = "projects/test-project"
TOPIC = f"{PROJECT}/topics/ledger"
OTHER_TOPIC = f"{PROJECT}/topics/other"
SUBSCRIPTION = f"{PROJECT}/subscriptions/ledger-sub"
SNAPSHOT = f"{PROJECT}/snapshots/before-the-bug"
LONG_AGO = datetime.datetime(2001, 1, 1, tzinfo=datetime.UTC)
FAR_AHEAD = datetime.datetime(2200, 1, 1, tzinfo=datetime.UTC)


def publish(publisher: pubsub_v1.PublisherClient, *data: bytes, topic: str = TOPIC) -> None:
    for future in [publisher.publish(topic, item) for item in data]:
        future.result(timeout=10)


def drain(subscriber: pubsub_v1.SubscriberClient, subscription: str = SUBSCRIPTION) -> list[bytes]:
    """Pull and acknowledge everything there is now; the data, sorted."""
    # return_immediately: an empty answer at once instead of after the server's Pull wait.
    request = {"subscription": subscription, "max_messages": 100, "return_immediately": True}
    response = subscriber.pull(request=request, timeout=10)
    received = response.received_messages
    if received:
        subscriber.acknowledge(subscription=subscription, ack_ids=[m.ack_id for m in received])
    return sorted(m.message.data for m in received)


def test_seek_to_a_snapshot_brings_back_what_it_captured(
    server: LocalServer, publisher: pubsub_v1.PublisherClient, subscriber: pubsub_v1.SubscriberClient
) -> None:
    publisher.create_topic(name=TOPIC)
    subscriber.create_subscription(name=SUBSCRIPTION, topic=TOPIC)
    publish(publisher, b"done")
    assert drain(subscriber) == [b"done"]
    publish(publisher, b"a", b"b")
    snapshot = subscriber.create_snapshot(
        request={"name": SNAPSHOT, "subscription": SUBSCRIPTION, "labels": {"why": "bug"}}
    )
    assert snapshot.topic == TOPIC and snapshot.labels["why"] == "bug"
    # Expires 7 days after its oldest unacknowledged message was published (just now).
    lifetime = snapshot.expire_time - datetime.datetime.now(datetime.UTC)
    assert datetime.timedelta(days=6, hours=23) < lifetime <= datetime.timedelta(days=7)
    publish(publisher, b"c")
    assert drain(subscriber) == [b"a", b"b", b"c"]
    assert drain(subscriber) == []

    subscriber.seek(request={"subscription": SUBSCRIPTION, "snapshot": SNAPSHOT})
    # What was unacknowledged when it was taken, and what was published after; not what came before.
    assert drain(subscriber) == [b"a", b"b", b"c"]
    assert server.wait_until_idle(timeout=10)


def test_seek_to_a_time_replays_retained_acknowledged_messages(
    server: LocalServer, publisher: pubsub_v1.PublisherClient, subscriber: pubsub_v1.SubscriberClient
) -> None:
    publisher.create_topic(name=TOPIC)
    subscriber.create_subscription(
        request={"name": SUBSCRIPTION, "topic": TOPIC, "retain_acked_messages": True}
    )
    publish(publisher, b"old-1", b"old-2")
    assert drain(subscriber) == [b"old-1", b"old-2"]
    middle = datetime.datetime.now(datetime.UTC)
    publish(publisher, b"new-1")
    assert drain(subscriber) == [b"new-1"]

    subscriber.seek(request={"subscription": SUBSCRIPTION, "time": middle})
    assert drain(subscriber) == [b"new-1"]
    subscriber.seek(request={"subscription": SUBSCRIPTION, "time": LONG_AGO})
    assert drain(subscriber) == [b"new-1", b"old-1", b"old-2"]
    # Seeking ahead acknowledges everything published before that time.
    publish(publisher, b"unread")
    subscriber.seek(request={"subscription": SUBSCRIPTION, "time": FAR_AHEAD})
    assert drain(subscriber) == []
    assert server.wait_until_idle(timeout=10)


def test_without_retention_a_seek_back_brings_nothing_acknowledged_back(
    server: LocalServer, publisher: pubsub_v1.PublisherClient, subscriber: pubsub_v1.SubscriberClient
) -> None:
    publisher.create_topic(name=TOPIC)
    subscriber.create_subscription(name=SUBSCRIPTION, topic=TOPIC)
    publish(publisher, b"read")
    assert drain(subscriber) == [b"read"]
    publish(publisher, b"unread")
    subscriber.seek(request={"subscription": SUBSCRIPTION, "time": LONG_AGO})
    assert drain(subscriber) == [b"unread"]


def test_topic_retention_replays_messages_from_before_the_subscription(
    server: LocalServer, publisher: pubsub_v1.PublisherClient, subscriber: pubsub_v1.SubscriberClient
) -> None:
    publisher.create_topic(request={"name": TOPIC, "message_retention_duration": {"seconds": 3600}})
    publish(publisher, b"early")
    created = subscriber.create_subscription(name=SUBSCRIPTION, topic=TOPIC)
    # The topic's retention shows in the subscription's output-only field.
    assert created.topic_message_retention_duration.total_seconds() == 3600
    assert subscriber.get_subscription(subscription=SUBSCRIPTION).topic_message_retention_duration
    publish(publisher, b"late")
    assert drain(subscriber) == [b"late"]
    subscriber.seek(request={"subscription": SUBSCRIPTION, "time": LONG_AGO})
    assert drain(subscriber) == [b"early", b"late"]
    # Without topic retention, nothing is kept for subscriptions that do not exist yet.
    publisher.create_topic(name=OTHER_TOPIC)
    publish(publisher, b"lost", topic=OTHER_TOPIC)
    other = f"{PROJECT}/subscriptions/other-sub"
    subscriber.create_subscription(name=other, topic=OTHER_TOPIC)
    subscriber.seek(request={"subscription": other, "time": LONG_AGO})
    assert drain(subscriber, other) == []


def test_a_streaming_subscriber_receives_what_a_seek_brings_back(
    server: LocalServer, publisher: pubsub_v1.PublisherClient, subscriber: pubsub_v1.SubscriberClient
) -> None:
    publisher.create_topic(name=TOPIC)
    subscriber.create_subscription(
        request={"name": SUBSCRIPTION, "topic": TOPIC, "retain_acked_messages": True}
    )
    received: queue.Queue[bytes] = queue.Queue()

    def callback(message: Any) -> None:
        received.put(message.data)
        message.ack()

    future = subscriber.subscribe(SUBSCRIPTION, callback)
    try:
        publish(publisher, b"one", b"two")
        assert sorted([received.get(timeout=10), received.get(timeout=10)]) == [b"one", b"two"]
        assert server.wait_until_idle(timeout=10)
        subscriber.seek(request={"subscription": SUBSCRIPTION, "time": LONG_AGO})
        assert sorted([received.get(timeout=10), received.get(timeout=10)]) == [b"one", b"two"]
    finally:
        future.cancel()
        future.result(timeout=10)


def test_snapshot_administration_and_errors(
    server: LocalServer, publisher: pubsub_v1.PublisherClient, subscriber: pubsub_v1.SubscriberClient
) -> None:
    publisher.create_topic(name=TOPIC)
    publisher.create_topic(name=OTHER_TOPIC)
    subscriber.create_subscription(name=SUBSCRIPTION, topic=TOPIC)
    other = f"{PROJECT}/subscriptions/other-sub"
    subscriber.create_subscription(name=other, topic=OTHER_TOPIC)
    subscriber.create_snapshot(name=SNAPSHOT, subscription=SUBSCRIPTION)
    with pytest.raises(exceptions.AlreadyExists, match="Resource already exists"):
        subscriber.create_snapshot(name=SNAPSHOT, subscription=SUBSCRIPTION)
    with pytest.raises(exceptions.NotFound):
        subscriber.create_snapshot(
            name=f"{PROJECT}/snapshots/nope", subscription=f"{PROJECT}/subscriptions/x-y"
        )
    with pytest.raises(exceptions.InvalidArgument, match="Invalid resource name"):
        subscriber.create_snapshot(name=f"{PROJECT}/snapshots/goog-x", subscription=SUBSCRIPTION)
    with pytest.raises(exceptions.NotFound, match="resource=missing"):
        subscriber.get_snapshot(snapshot=f"{PROJECT}/snapshots/missing")
    with pytest.raises(exceptions.FailedPrecondition, match="another topic"):
        subscriber.seek(request={"subscription": other, "snapshot": SNAPSHOT})
    with pytest.raises(exceptions.NotFound):
        subscriber.seek(request={"subscription": SUBSCRIPTION, "snapshot": f"{PROJECT}/snapshots/missing"})
    with pytest.raises(exceptions.InvalidArgument, match="Invalid resource name"):
        subscriber.seek(request={"subscription": SUBSCRIPTION, "snapshot": ""})
    with pytest.raises(exceptions.InvalidArgument, match="either a time or a snapshot"):
        subscriber.seek(request={"subscription": SUBSCRIPTION})

    for index in range(3):
        subscriber.create_snapshot(name=f"{PROJECT}/snapshots/extra-{index}", subscription=SUBSCRIPTION)
    listed = [s.name for s in subscriber.list_snapshots(request={"project": PROJECT, "page_size": 2})]
    assert listed == sorted(listed) and len(listed) == 4
    assert sorted(publisher.list_topic_snapshots(request={"topic": TOPIC})) == listed
    assert list(publisher.list_topic_snapshots(request={"topic": OTHER_TOPIC})) == []

    updated = subscriber.update_snapshot(
        snapshot={"name": SNAPSHOT, "labels": {"team": "ledger"}},
        update_mask=field_mask_pb2.FieldMask(paths=["labels"]),
    )
    assert updated.labels["team"] == "ledger"
    past = timestamp_pb2.Timestamp(seconds=1000)
    with pytest.raises(exceptions.InvalidArgument, match="expire time"):
        subscriber.update_snapshot(
            snapshot={"name": SNAPSHOT, "expire_time": past},
            update_mask=field_mask_pb2.FieldMask(paths=["expire_time"]),
        )
    with pytest.raises(exceptions.InvalidArgument, match="update_mask"):
        subscriber.update_snapshot(
            snapshot={"name": SNAPSHOT, "topic": OTHER_TOPIC},
            update_mask=field_mask_pb2.FieldMask(paths=["topic"]),
        )
    subscriber.delete_snapshot(snapshot=SNAPSHOT)
    with pytest.raises(exceptions.NotFound):
        subscriber.delete_snapshot(snapshot=SNAPSHOT)
    # A snapshot outlives its subscription.
    subscriber.delete_subscription(subscription=SUBSCRIPTION)
    assert subscriber.get_snapshot(snapshot=f"{PROJECT}/snapshots/extra-0").topic == TOPIC


# ---------------------------------------------------------------- durable over a SIGKILL of `hedgepub serve`
def test_snapshots_and_retained_messages_survive_a_sigkill(hedgepub_serve: Any) -> None:
    first = hedgepub_serve()
    publisher, subscriber = pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
    try:
        publisher.create_topic(name=TOPIC)
        subscriber.create_subscription(
            request={"name": SUBSCRIPTION, "topic": TOPIC, "retain_acked_messages": True}
        )
        publish(publisher, b"kept-1", b"kept-2")
        subscriber.create_snapshot(name=SNAPSHOT, subscription=SUBSCRIPTION)
        assert drain(subscriber) == [b"kept-1", b"kept-2"]
        publish(publisher, b"after")
    finally:
        publisher.transport.close()
        subscriber.close()
    first.send_signal(signal.SIGKILL)  # nothing is flushed or closed
    first.wait(10)

    hedgepub_serve()
    publisher, subscriber = pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
    try:
        assert subscriber.get_snapshot(snapshot=SNAPSHOT).topic == TOPIC
        assert drain(subscriber) == [b"after"]
        subscriber.seek(request={"subscription": SUBSCRIPTION, "time": LONG_AGO})
        assert drain(subscriber) == [b"after", b"kept-1", b"kept-2"]
        subscriber.seek(request={"subscription": SUBSCRIPTION, "snapshot": SNAPSHOT})
        assert drain(subscriber) == [b"after", b"kept-1", b"kept-2"]
    finally:
        publisher.transport.close()
        subscriber.close()
