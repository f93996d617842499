"""The real service's limits and status codes, through raw gRPC calls."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.iam.v1 import iam_policy_pb2
from google.pubsub_v1.types import pubsub as types

from hedgepub.server import LocalServer

from ..._pb import (
    AcknowledgeRequest,
    GetSubscriptionRequest,
    ModifyAckDeadlineRequest,
    PublishRequest,
    PubsubMessage,
    PullRequest,
    StreamingPullRequest,
    StreamingPullResponse,
    Subscription,
    Topic,
)

PROJECT = "projects/test-project"
TOPIC = f"{PROJECT}/topics/limits"
SUBSCRIPTION = f"{PROJECT}/subscriptions/limits-sub"

INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture
def ready(raw: Any) -> Any:
    """A raw client with a topic and a subscription on it."""
    raw.call("CreateTopic", Topic(name=TOPIC))
    raw.call("CreateSubscription", Subscription(name=SUBSCRIPTION, topic=TOPIC))
    return raw


def publish(raw: Any, *messages: Any, topic: str = TOPIC) -> Any:
    return raw.call("Publish", PublishRequest(topic=topic, messages=list(messages)))


@pytest.mark.parametrize(
    "name",
    [
        "projects/p/topics/ab",  # too short
        "projects/p/topics/" + "a" * 256,  # too long
        "projects/p/topics/1abc",  # starts with a digit
        "projects/p/topics/goog-topic",  # reserved prefix
        "projects/p/topics/has space",
        "projects/p/topics/slash/extra",
        "p/topics/abc",
        "projects/p/subscriptions/abc",
        "",
    ],
)
def test_bad_topic_names_are_invalid_argument(raw: Any, name: str) -> None:
    error = raw.error("CreateTopic", Topic(name=name))
    assert error.code() == INVALID
    assert "Invalid resource name given" in error.details()


def test_good_names_at_the_limits_are_accepted(raw: Any) -> None:
    for topic_id in ("abc", "a" * 255, "A-b_c.d~e+f%g"):
        raw.call("CreateTopic", Topic(name=f"projects/p/topics/{topic_id}"))


def test_not_found_and_already_exists(ready: Any) -> None:
    missing = f"{PROJECT}/topics/missing"
    for method, request in [
        ("GetTopic", types.GetTopicRequest.pb()(topic=missing)),
        ("DeleteTopic", types.DeleteTopicRequest.pb()(topic=missing)),
        ("Publish", PublishRequest(topic=missing, messages=[PubsubMessage(data=b"x")])),
        ("GetSubscription", GetSubscriptionRequest(subscription=f"{PROJECT}/subscriptions/nope")),
        ("Pull", PullRequest(subscription=f"{PROJECT}/subscriptions/nope", max_messages=1)),
    ]:
        error = ready.error(method, request)
        assert error.code() == grpc.StatusCode.NOT_FOUND, method
        assert error.details().startswith("Resource not found (resource=")
    assert ready.error("CreateTopic", Topic(name=TOPIC)).code() == grpc.StatusCode.ALREADY_EXISTS
    duplicate = Subscription(name=SUBSCRIPTION, topic=TOPIC)
    assert ready.error("CreateSubscription", duplicate).code() == grpc.StatusCode.ALREADY_EXISTS


def test_publish_limits(ready: Any) -> None:
    cases: list[tuple[list[Any], str]] = [
        ([PubsubMessage()], "is empty"),
        ([PubsubMessage(data=b"x")] * 1001, "message_count"),
        ([PubsubMessage(data=b"x" * 10_000_001)], "too large"),
        ([PubsubMessage(data=b"x", attributes={f"k{i}": "v" for i in range(101)})], "attributes_count"),
        ([PubsubMessage(data=b"x", attributes={"k" * 257: "v"})], "attribute_key_size"),
        ([PubsubMessage(data=b"x", attributes={"k": "v" * 1025})], "attribute_value_size"),
        ([PubsubMessage(data=b"x", ordering_key="o" * 1025)], "ordering_key_size"),
        ([PubsubMessage(data=b"x" * 6_000_000), PubsubMessage(data=b"y" * 6_000_000)], "request_size"),
        ([], "no messages"),
    ]
    for messages, words in cases:
        error = ready.error("Publish", PublishRequest(topic=TOPIC, messages=messages))
        assert error.code() == INVALID, words
        assert words in error.details()
    # At the limits, everything is accepted.
    publish(ready, *[PubsubMessage(data=b"x")] * 1000)
    publish(ready, PubsubMessage(attributes={"only": "attributes"}))
    publish(ready, PubsubMessage(data=b"x" * 9_999_000))
    publish(
        ready,
        PubsubMessage(
            data=b"x",
            attributes={("k" * 250 + f"{i:03d}")[:256]: "v" * 1024 for i in range(100)},
            ordering_key="o" * 1024,
        ),
    )


def test_publish_checks_every_message_of_a_request_of_plain_ones(ready: Any) -> None:
    """Requests of data-only messages skip the per-message checks; one other message among them is still
    checked, whatever its place and however its bytes are written."""
    plain = [PubsubMessage(data=b"x" * 100)] * 99
    for odd, words in [
        (PubsubMessage(ordering_key="k"), "is empty"),
        (PubsubMessage(message_id="1"), "is empty"),
        (PubsubMessage(data=b"x", attributes={"GOOG-key": "v"}), "must not start with 'goog'"),
        (PubsubMessage(data=b"x", ordering_key="o" * 1025), "ordering_key_size"),
    ]:
        for messages in ([odd, *plain], [*plain, odd]):
            error = ready.error("Publish", PublishRequest(topic=TOPIC, messages=messages))
            assert error.code() == INVALID, words
            assert words in error.details(), words
    stub = ready.channel.unary_unary(
        "/google.pubsub.v1.Publisher/Publish",
        request_serializer=lambda b: b,
        response_deserializer=types.PublishResponse.pb().FromString,
    )
    request = PublishRequest(topic=TOPIC, messages=plain).SerializeToString()
    # Written by hand: a message whose data is present but empty, one with only a field no version of
    # PubsubMessage has (number 111), each after 99 plain ones.
    for odd in (b"\x12\x02\x0a\x00", b"\x12\x03\xf8\x06\x01"):
        with pytest.raises(grpc.RpcError) as caught:
            stub(request + odd, timeout=10)
        assert caught.value.code() == INVALID
        assert "is empty" in caught.value.details()
    # Data beside an unknown field is a message with data.
    answer = stub(request + b"\x12\x06\x0a\x01y\xf8\x06\x01", timeout=10)
    assert len(answer.message_ids) == 100
    received: list[bytes] = []
    while len(received) < 100:
        pulled = ready.call("Pull", PullRequest(subscription=SUBSCRIPTION, max_messages=1000))
        received += [message.message.data for message in pulled.received_messages]
    assert sorted(received) == [b"x" * 100] * 99 + [b"y"]


def test_ack_deadline_limits(ready: Any) -> None:
    for seconds in (5, 601):
        error = ready.error(
            "CreateSubscription",
            Subscription(
                name=f"{PROJECT}/subscriptions/dl-{seconds}", topic=TOPIC, ack_deadline_seconds=seconds
            ),
        )
        assert error.code() == INVALID and "ack deadline" in error.details()
    publish(ready, PubsubMessage(data=b"x"))
    pulled = ready.call("Pull", PullRequest(subscription=SUBSCRIPTION, max_messages=1))
    ack_id = pulled.received_messages[0].ack_id
    for seconds in (-1, 601):
        request = ModifyAckDeadlineRequest(
            subscription=SUBSCRIPTION, ack_ids=[ack_id], ack_deadline_seconds=seconds
        )
        assert ready.error("ModifyAckDeadline", request).code() == INVALID
    bad_ack = AcknowledgeRequest(subscription=SUBSCRIPTION, ack_ids=["not-an-ack-id"])
    assert ready.error("Acknowledge", bad_ack).code() == INVALID


@pytest.mark.parametrize("max_messages", [0, -1])
def test_pull_needs_positive_max_messages(ready: Any, max_messages: int) -> None:
    error = ready.error("Pull", PullRequest(subscription=SUBSCRIPTION, max_messages=max_messages))
    assert error.code() == INVALID and "max_messages" in error.details()


def test_streaming_pull_checks_its_first_request(ready: Any) -> None:
    stub = ready.channel.stream_stream(
        "/google.pubsub.v1.Subscriber/StreamingPull",
        request_serializer=StreamingPullRequest.SerializeToString,
        response_deserializer=StreamingPullResponse.FromString,
    )
    first = StreamingPullRequest(subscription=SUBSCRIPTION, stream_ack_deadline_seconds=3)
    with pytest.raises(grpc.RpcError) as caught:
        list(stub(iter([first]), timeout=5))
    assert caught.value.code() == INVALID


def test_bad_page_token_and_update_mask(ready: Any) -> None:
    request = types.ListTopicsRequest.pb()(project=PROJECT, page_token="garbage!")
    assert ready.error("ListTopics", request).code() == INVALID
    update = types.UpdateTopicRequest.pb()(topic=Topic(name=TOPIC))
    assert ready.error("UpdateTopic", update).code() == INVALID  # empty mask
    update.update_mask.paths.append("name")
    assert ready.error("UpdateTopic", update).code() == INVALID


def test_detached_subscription_refuses_pulls(ready: Any) -> None:
    ready.call("DetachSubscription", types.DetachSubscriptionRequest.pb()(subscription=SUBSCRIPTION))
    error = ready.error("Pull", PullRequest(subscription=SUBSCRIPTION, max_messages=1))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_test_iam_permissions_refuses_foreign_permissions(ready: Any) -> None:
    request = iam_policy_pb2.TestIamPermissionsRequest(
        resource=TOPIC, permissions=["pubsub.subscriptions.consume"]
    )
    assert ready.error("TestIamPermissions", request).code() == INVALID


def test_unimplemented_methods_and_services_say_so(pubsub_server: LocalServer, raw: Any) -> None:
    for path in (
        "/google.pubsub.v1.Subscriber/NoSuchMethod",
        "/google.pubsub.v1.Publisher/NoSuchMethod",
        "/google.pubsub.v1.SchemaService/NoSuchMethod",
        "/no.such.Service/Method",
    ):
        stub = raw.channel.unary_unary(path, request_serializer=lambda _: b"", response_deserializer=bytes)
        with pytest.raises(grpc.RpcError) as caught:
            stub(b"", timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert path in caught.value.details()


def test_malformed_request_bytes_are_invalid_argument(raw: Any) -> None:
    stub = raw.channel.unary_unary(
        "/google.pubsub.v1.Publisher/Publish", request_serializer=lambda b: b, response_deserializer=bytes
    )
    with pytest.raises(grpc.RpcError) as caught:
        stub(b"\xff\xff\xff", timeout=5)
    assert caught.value.code() == INVALID
