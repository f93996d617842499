"""The official google-cloud-pubsub client against the server, on both stores."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from google.api_core import exceptions
from google.cloud import pubsub_v1
from google.protobuf import field_mask_pb2

from hedgepub.server import LocalServer

PROJECT = "projects/test-project"
TOPIC = f"{PROJECT}/topics/orders"
SUBSCRIPTION = f"{PROJECT}/subscriptions/orders-sub"


def test_topic_admin(server: LocalServer, publisher: pubsub_v1.PublisherClient) -> None:
    created = publisher.create_topic(request={"name": TOPIC, "labels": {"team": "a"}})
    assert created.name == TOPIC
    assert publisher.get_topic(topic=TOPIC).labels["team"] == "a"
    with pytest.raises(exceptions.AlreadyExists, match="Resource already exists"):
        publisher.create_topic(name=TOPIC)
    updated = publisher.update_topic(
        topic={"name": TOPIC, "labels": {"team": "b"}}, update_mask=field_mask_pb2.FieldMask(paths=["labels"])
    )
    assert updated.labels["team"] == "b"
    for index in range(5):
        publisher.create_topic(name=f"{PROJECT}/topics/extra-{index}")
    names = [topic.name for topic in publisher.list_topics(request={"project": PROJECT, "page_size": 2})]
    assert names == sorted(names) and len(names) == 6
    publisher.delete_topic(topic=TOPIC)
    with pytest.raises(exceptions.NotFound, match=r"Resource not found \(resource=orders\)"):
        publisher.get_topic(topic=TOPIC)


def test_subscription_admin(
    server: LocalServer, publisher: pubsub_v1.PublisherClient, subscriber: pubsub_v1.SubscriberClient
) -> None:
    with pytest.raises(exceptions.NotFound):
        subscriber.create_subscription(name=SUBSCRIPTION, topic=TOPIC)
    publisher.create_topic(name=TOPIC)
    created = subscriber.create_subscription(name=SUBSCRIPTION, topic=TOPIC)
    assert created.ack_deadline_seconds == 10
    assert created.message_retention_duration.total_seconds() == 7 * 24 * 3600
    for index in range(3):
        subscriber.create_subscription(name=f"{PROJECT}/subscriptions/more-{index}", topic=TOPIC)
    listed = [s.name for s in subscriber.list_subscriptions(request={"project": PROJECT, "page_size": 3})]
    assert len(listed) == 4
    attached = list(publisher.list_topic_subscriptions(request={"topic": TOPIC, "page_size": 1}))
    assert sorted(attached) == sorted(listed)
    updated = subscriber.update_subscription(
        subscription={"name": SUBSCRIPTION, "ack_deadline_seconds": 42},
        update_mask=field_mask_pb2.FieldMask(paths=["ack_deadline_seconds"]),
    )
    assert updated.ack_deadline_seconds == 42
    assert subscriber.get_subscription(subscription=SUBSCRIPTION).ack_deadline_seconds == 42
    with pytest.raises(exceptions.InvalidArgument, match="update_mask"):
        subscriber.update_subscription(
            subscription={"name": SUBSCRIPTION, "topic": TOPIC},
            update_mask=field_mask_pb2.FieldMask(paths=["topic"]),
        )
    publisher.delete_topic(topic=TOPIC)
    assert subscriber.get_subscription(subscription=SUBSCRIPTION).topic == "_deleted-topic_"
    subscriber.delete_subscription(subscription=SUBSCRIPTION)
    with pytest.raises(exceptions.NotFound):
        subscriber.get_subscription(subscription=SUBSCRIPTION)


@pytest.mark.filterwarnings("ignore:The return_immediately flag is deprecated")
def test_publish_with_attributes_and_sync_pull(
    server: LocalServer, publisher: pubsub_v1.PublisherClient, subscriber: pubsub_v1.SubscriberClient
) -> None:
    publisher.create_topic(name=TOPIC)
    subscriber.create_subscription(name=SUBSCRIPTION, topic=TOPIC)
    ids = [publisher.publish(TOPIC, f"m{i}".encode(), origin="test", index=str(i)).result() for i in range(3)]
    assert len(set(ids)) == 3
    stored = server.messages(TOPIC)
    assert [m.message_id for m in stored] == ids
    assert stored[1].data == b"m1" and stored[1].attributes == {"origin": "test", "index": "1"}
    response = subscriber.pull(subscription=SUBSCRIPTION, max_messages=10)
    received = response.received_messages
    assert [r.message.data for r in received] == [b"m0", b"m1", b"m2"]
    assert received[0].message.publish_time is not None
    subscriber.acknowledge(subscription=SUBSCRIPTION, ack_ids=[r.ack_id for r in received])
    assert (
        subscriber.pull(subscription=SUBSCRIPTION, max_messages=10, return_immediately=True).received_messages
        == []
    )


def test_nack_by_deadline_zero_redelivers_with_a_new_ack_id(
    server: LocalServer, publisher: pubsub_v1.PublisherClient, subscriber: pubsub_v1.SubscriberClient
) -> None:
    publisher.create_topic(name=TOPIC)
    subscriber.create_subscription(name=SUBSCRIPTION, topic=TOPIC)
    publisher.publish(TOPIC, b"again").result()
    first = subscriber.pull(subscription=SUBSCRIPTION, max_messages=1).received_messages[0]
    subscriber.modify_ack_deadline(subscription=SUBSCRIPTION, ack_ids=[first.ack_id], ack_deadline_seconds=0)
    second = subscriber.pull(subscription=SUBSCRIPTION, max_messages=1).received_messages[0]
    assert second.message.message_id == first.message.message_id
    assert second.ack_id != first.ack_id


def test_fan_out_to_every_subscription(
    server: LocalServer, publisher: pubsub_v1.PublisherClient, subscriber: pubsub_v1.SubscriberClient
) -> None:
    publisher.create_topic(name=TOPIC)
    names = [f"{PROJECT}/subscriptions/fan-{i}" for i in range(3)]
    for name in names:
        subscriber.create_subscription(name=name, topic=TOPIC)
    publisher.publish(TOPIC, b"everyone").result()
    for name in names:
        received = subscriber.pull(subscription=name, max_messages=5).received_messages
        assert [r.message.data for r in received] == [b"everyone"]


def test_streaming_pull_ack_and_nack_redelivery(
    server: LocalServer,
    publisher: pubsub_v1.PublisherClient,
    subscriber: pubsub_v1.SubscriberClient,
    wait_for: Callable[..., bool],
) -> None:
    publisher.create_topic(name=TOPIC)
    subscriber.create_subscription(name=SUBSCRIPTION, topic=TOPIC)
    lock = threading.Lock()
    seen: list[tuple[bytes, int]] = []
    acked: list[bytes] = []
    nacked_once: set[bytes] = set()

    def callback(message: Any) -> None:
        with lock:
            seen.append((message.data, 0))
            if message.data.endswith(b"-nack") and message.data not in nacked_once:
                nacked_once.add(message.data)
                message.nack()
                return
            acked.append(message.data)
        message.ack()

    future = subscriber.subscribe(SUBSCRIPTION, callback)
    try:
        expected = {b"a", b"b-nack", b"c"}
        for data in sorted(expected):
            publisher.publish(TOPIC, data).result()
        assert wait_for(lambda: set(acked) == expected)
        with lock:
            deliveries = [data for data, _ in seen]
        assert deliveries.count(b"b-nack") == 2
    finally:
        future.cancel()
    assert server.wait_until_idle(timeout=10)


def test_ordering_keys_deliver_in_order(
    server: LocalServer, subscriber: pubsub_v1.SubscriberClient, wait_for: Callable[..., bool]
) -> None:
    ordered_publisher = pubsub_v1.PublisherClient(
        publisher_options=pubsub_v1.types.PublisherOptions(enable_message_ordering=True)
    )
    try:
        ordered_publisher.create_topic(name=TOPIC)
        subscriber.create_subscription(
            request={"name": SUBSCRIPTION, "topic": TOPIC, "enable_message_ordering": True}
        )
        futures = [
            ordered_publisher.publish(TOPIC, f"{key}-{i}".encode(), ordering_key=key)
            for i in range(10)
            for key in ("red", "blue")
        ]
        for publish_future in futures:
            publish_future.result()
    finally:
        ordered_publisher.stop()
    assert {m.ordering_key for m in server.messages(TOPIC)} == {"red", "blue"}
    received: dict[str, list[int]] = {"red": [], "blue": []}
    lock = threading.Lock()

    def callback(message: Any) -> None:
        key, index = message.data.decode().split("-")
        with lock:
            received[key].append(int(index))
        message.ack()

    future = subscriber.subscribe(SUBSCRIPTION, callback)
    try:
        assert wait_for(lambda: sum(map(len, received.values())) >= 20)
    finally:
        future.cancel()
    assert received == {"red": list(range(10)), "blue": list(range(10))}


AVRO = '{"type": "record", "name": "Order", "fields": [{"name": "id", "type": "int"}]}'


@pytest.mark.parametrize("kind", ["topics", "subscriptions", "snapshots", "schemas"])
def test_iam_policies_are_stored(
    server: LocalServer,
    publisher: pubsub_v1.PublisherClient,
    subscriber: pubsub_v1.SubscriberClient,
    kind: str,
) -> None:
    """Get/SetIamPolicy on each resource type, through the client of its service (the IAM mixin)."""
    schemas = pubsub_v1.SchemaServiceClient()
    name = f"{PROJECT}/{kind}/guarded"
    publisher.create_topic(name=TOPIC)
    subscriber.create_subscription(name=SUBSCRIPTION, topic=TOPIC)
    client: Any = {"topics": publisher, "schemas": schemas}.get(kind, subscriber)
    create: Callable[[], Any] = {
        "topics": lambda: publisher.create_topic(name=name),
        "subscriptions": lambda: subscriber.create_subscription(name=name, topic=TOPIC),
        "snapshots": lambda: subscriber.create_snapshot(name=name, subscription=SUBSCRIPTION),
        "schemas": lambda: schemas.create_schema(
            parent=PROJECT, schema={"type_": "AVRO", "definition": AVRO}, schema_id="guarded"
        ),
    }[kind]
    delete: Callable[[], Any] = {
        "topics": lambda: publisher.delete_topic(topic=name),
        "subscriptions": lambda: subscriber.delete_subscription(subscription=name),
        "snapshots": lambda: subscriber.delete_snapshot(snapshot=name),
        "schemas": lambda: schemas.delete_schema(name=name),
    }[kind]
    try:
        with pytest.raises(exceptions.NotFound):
            client.get_iam_policy(request={"resource": name})
        with pytest.raises(exceptions.NotFound):
            client.set_iam_policy(request={"resource": name, "policy": {}})
        create()
        empty = client.get_iam_policy(request={"resource": name})
        assert list(empty.bindings) == []
        binding = {"role": "roles/pubsub.viewer", "members": ["user:a@example.com"]}
        policy = client.set_iam_policy(request={"resource": name, "policy": {"bindings": [binding]}})
        assert policy.etag != empty.etag
        read = client.get_iam_policy(request={"resource": name})
        assert (read.bindings[0].role, list(read.bindings[0].members), read.etag) == (
            "roles/pubsub.viewer",
            ["user:a@example.com"],
            policy.etag,
        )
        with pytest.raises(exceptions.Aborted):
            client.set_iam_policy(request={"resource": name, "policy": {"etag": empty.etag or b"stale"}})
        asked = [f"pubsub.{kind}.setIamPolicy", f"pubsub.{kind}.get"]
        granted = client.test_iam_permissions(request={"resource": name, "permissions": asked})
        assert list(granted.permissions) == asked
        # The policy goes with its resource: one created again under the name starts with none.
        delete()
        with pytest.raises(exceptions.NotFound):
            client.get_iam_policy(request={"resource": name})
        create()
        assert list(client.get_iam_policy(request={"resource": name}).bindings) == []
    finally:
        schemas.transport.close()


def test_pytest_fixture_sets_the_emulator_host(pubsub_server: LocalServer) -> None:
    import os

    assert os.environ["PUBSUB_EMULATOR_HOST"] == pubsub_server.address
    assert pubsub_server.address.startswith("127.0.0.1:")
