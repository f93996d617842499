"""Restart durability in-process: stop a SQLite-backed server, start a new one on the same data dir."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.iam.v1 import iam_policy_pb2, policy_pb2
from google.pubsub_v1.types import pubsub as types
from google.pubsub_v1.types import schema as schema_types

from hedgepub.server import LocalServer
from hedgepub.server._store.datadir import database_path

from ..._pb import (
    AcknowledgeRequest,
    GetSubscriptionRequest,
    PublishRequest,
    PublishResponse,
    PubsubMessage,
    PullRequest,
    PullResponse,
    Snapshot,
    Subscription,
    Topic,
)

TOPIC = "projects/p/topics/durable"
SUBSCRIPTION = "projects/p/subscriptions/durable-sub"
ORDERED = "projects/p/subscriptions/durable-ordered"
SCHEMA = "projects/p/schemas/durable-schema"
SNAPSHOT = "projects/p/snapshots/durable-snapshot"
#: The resources given an IAM policy before the restart, each a policy of its own.
GUARDED = (TOPIC, SCHEMA, SNAPSHOT)


def call(channel: grpc.Channel, path: str, request: Any, response: Any) -> Any:
    stub = channel.unary_unary(
        path, request_serializer=type(request).SerializeToString, response_deserializer=response.FromString
    )
    return stub(request, timeout=10)


def publisher(channel: grpc.Channel, method: str, request: Any, response: Any) -> Any:
    return call(channel, f"/google.pubsub.v1.Publisher/{method}", request, response)


def subscriber(channel: grpc.Channel, method: str, request: Any, response: Any) -> Any:
    return call(channel, f"/google.pubsub.v1.Subscriber/{method}", request, response)


def pull(channel: grpc.Channel, subscription: str) -> list[Any]:
    request = PullRequest(subscription=subscription, max_messages=100, return_immediately=True)
    return list(subscriber(channel, "Pull", request, PullResponse).received_messages)


def test_everything_but_acknowledged_messages_survives_a_restart(tmp_path: Path) -> None:
    empty = types.DeleteTopicRequest.pb()  # any message class works as a placeholder response parser
    with LocalServer(data_dir=tmp_path) as server, grpc.insecure_channel(server.address) as channel:
        publisher(channel, "CreateTopic", Topic(name=TOPIC, labels={"k": "v"}), Topic)
        for name, ordered in ((SUBSCRIPTION, False), (ORDERED, True)):
            config = Subscription(
                name=name, topic=TOPIC, ack_deadline_seconds=30, enable_message_ordering=ordered
            )
            subscriber(channel, "CreateSubscription", config, Subscription)
        avro = schema_types.Schema.pb()(type_=schema_types.Schema.Type.AVRO, definition='"string"')
        call(
            channel,
            "/google.pubsub.v1.SchemaService/CreateSchema",
            schema_types.CreateSchemaRequest.pb()(
                parent="projects/p", schema=avro, schema_id="durable-schema"
            ),
            schema_types.Schema.pb(),
        )
        snapshot = types.CreateSnapshotRequest.pb()(name=SNAPSHOT, subscription=ORDERED)
        subscriber(channel, "CreateSnapshot", snapshot, Snapshot)
        etags = {}
        for resource in GUARDED:
            policy = policy_pb2.Policy(
                bindings=[
                    policy_pb2.Binding(
                        role="roles/pubsub.viewer", members=[f"user:{resource.split('/')[2]}@example.com"]
                    )
                ]
            )
            etags[resource] = call(
                channel,
                "/google.iam.v1.IAMPolicy/SetIamPolicy",
                iam_policy_pb2.SetIamPolicyRequest(resource=resource, policy=policy),
                policy_pb2.Policy,
            ).etag
        messages = [
            PubsubMessage(data=f"m{i}".encode(), attributes={"i": str(i)}, ordering_key="k") for i in range(4)
        ]
        published = publisher(
            channel,
            "Publish",
            PublishRequest(topic=TOPIC, messages=messages),
            PublishResponse,
        )
        received = pull(channel, SUBSCRIPTION)
        acked = [r.ack_id for r in received if r.message.data in (b"m0", b"m2")]
        subscriber(
            channel,
            "Acknowledge",
            AcknowledgeRequest(subscription=SUBSCRIPTION, ack_ids=acked),
            empty,
        )

    with LocalServer(data_dir=tmp_path) as server, grpc.insecure_channel(server.address) as channel:
        topic = publisher(channel, "GetTopic", types.GetTopicRequest.pb()(topic=TOPIC), Topic)
        assert topic.labels["k"] == "v"
        config = subscriber(
            channel,
            "GetSubscription",
            GetSubscriptionRequest(subscription=ORDERED),
            Subscription,
        )
        assert config.enable_message_ordering and config.ack_deadline_seconds == 30
        for resource in GUARDED:
            stored_policy = call(
                channel,
                "/google.iam.v1.IAMPolicy/GetIamPolicy",
                iam_policy_pb2.GetIamPolicyRequest(resource=resource),
                policy_pb2.Policy,
            )
            [binding] = stored_policy.bindings
            assert (binding.role, list(binding.members), stored_policy.etag) == (
                "roles/pubsub.viewer",
                [f"user:{resource.split('/')[2]}@example.com"],
                etags[resource],
            )
        left = pull(channel, SUBSCRIPTION)
        assert sorted((r.message.data, r.message.attributes["i"]) for r in left) == [
            (b"m1", "1"),
            (b"m3", "3"),
        ]
        # The ordered subscription acknowledged nothing: its key comes back whole, in order.
        assert [r.message.data for r in pull(channel, ORDERED)] == [b"m0", b"m1", b"m2", b"m3"]
        assert [m.message_id for m in server.messages(TOPIC)] == list(published.message_ids)
        more = publisher(
            channel,
            "Publish",
            PublishRequest(topic=TOPIC, messages=[PubsubMessage(data=b"new")]),
            PublishResponse,
        )
        assert more.message_ids[0] not in published.message_ids


def test_a_policy_left_behind_by_a_crash_is_not_inherited_by_a_new_resource_of_its_name(
    tmp_path: Path,
) -> None:
    policy = policy_pb2.Policy(
        bindings=[policy_pb2.Binding(role="roles/pubsub.admin", members=["user:old@example.com"])]
    )
    with LocalServer(data_dir=tmp_path) as server, grpc.insecure_channel(server.address) as channel:
        publisher(channel, "CreateTopic", Topic(name=TOPIC), Topic)
        call(
            channel,
            "/google.iam.v1.IAMPolicy/SetIamPolicy",
            iam_policy_pb2.SetIamPolicyRequest(resource=TOPIC, policy=policy),
            policy_pb2.Policy,
        )
    # A crash between DeleteTopic's two writes: the topic's row is gone, its policy's is not.
    database = sqlite3.connect(database_path(tmp_path))
    with database:
        database.execute("DELETE FROM topics WHERE name = ?", (TOPIC,))
    database.close()
    with LocalServer(data_dir=tmp_path) as server, grpc.insecure_channel(server.address) as channel:
        publisher(channel, "CreateTopic", Topic(name=TOPIC), Topic)
        stored = call(
            channel,
            "/google.iam.v1.IAMPolicy/GetIamPolicy",
            iam_policy_pb2.GetIamPolicyRequest(resource=TOPIC),
            policy_pb2.Policy,
        )
        assert list(stored.bindings) == []
    # And the left-over row is gone from the file, so no later start finds it either.
    database = sqlite3.connect(database_path(tmp_path))
    try:
        assert database.execute("SELECT name FROM policies").fetchall() == []
    finally:
        database.close()


@pytest.mark.quickjs
def test_ids_of_messages_a_topic_transform_filtered_out_are_not_given_again_after_a_restart(
    tmp_path: Path,
) -> None:
    """A Publish whose every message the topic's transform drops stores nothing, yet its IDs were
    answered: after a restart the next message must get another ID."""
    drop_all = {
        "javascript_udf": {"function_name": "dropAll", "code": "function dropAll(m, a) { return null; }"}
    }
    with LocalServer(data_dir=tmp_path) as server, grpc.insecure_channel(server.address) as channel:
        publisher(channel, "CreateTopic", Topic(name=TOPIC, message_transforms=[drop_all]), Topic)
        subscriber(channel, "CreateSubscription", Subscription(name=SUBSCRIPTION, topic=TOPIC), Subscription)
        request = PublishRequest(topic=TOPIC, messages=[PubsubMessage(data=b"dropped")] * 3)
        dropped = list(publisher(channel, "Publish", request, PublishResponse).message_ids)
    with LocalServer(data_dir=tmp_path) as server, grpc.insecure_channel(server.address) as channel:
        assert pull(channel, SUBSCRIPTION) == []
        request = PublishRequest(topic=TOPIC, messages=[PubsubMessage(data=b"after")])
        (after,) = publisher(channel, "Publish", request, PublishResponse).message_ids
    assert len(set(dropped)) == 3 and after not in dropped
    assert int(after) > max(map(int, dropped))
