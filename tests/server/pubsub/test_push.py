"""Push subscriptions against a real HTTP endpoint on 127.0.0.1, through the official clients."""

from __future__ import annotations

import base64
import itertools
import json
import time
from typing import Any

import pytest
from google.api_core import exceptions
from google.cloud import pubsub_v1

from hedgepub.server import LocalServer

PROJECT = "projects/push-project"
TOPIC = f"{PROJECT}/topics/events"
SUBSCRIPTION = f"{PROJECT}/subscriptions/events-push"


def _bodies(endpoint: Any) -> list[dict[str, Any]]:
    return [json.loads(request.body) for request in endpoint.requests]


def test_wrapped_messages_are_posted_and_acknowledged(
    server: LocalServer,
    publisher: pubsub_v1.PublisherClient,
    subscriber: pubsub_v1.SubscriberClient,
    push_endpoint: Any,
) -> None:
    publisher.create_topic(name=TOPIC)
    subscriber.create_subscription(
        request={"name": SUBSCRIPTION, "topic": TOPIC, "push_config": {"push_endpoint": push_endpoint.url}}
    )
    ids = [publisher.publish(TOPIC, f"event {i}".encode(), n=str(i)).result(timeout=30) for i in range(3)]
    assert push_endpoint.wait_for(lambda requests: len(requests) >= 3)
    assert server.wait_until_idle(timeout=10)  # every message was acknowledged by the 200
    request = push_endpoint.requests[0]
    assert request.path == "/push"
    assert request.headers["Content-Type"] == "application/json"
    by_id = {body["message"]["messageId"]: body for body in _bodies(push_endpoint)}
    assert sorted(by_id) == sorted(ids)
    for i, message_id in enumerate(ids):
        body = by_id[message_id]
        message = body["message"]
        assert body["subscription"] == SUBSCRIPTION
        assert base64.b64decode(message["data"]) == f"event {i}".encode()
        assert message["attributes"] == {"n": str(i)}
        assert message["message_id"] == message_id
        assert message["publishTime"] == message["publish_time"]
        assert message["publishTime"].endswith("Z")
        assert "deliveryAttempt" not in body


def test_unwrapped_messages_carry_the_data_as_body_and_metadata_as_headers(
    server: LocalServer,
    publisher: pubsub_v1.PublisherClient,
    subscriber: pubsub_v1.SubscriberClient,
    push_endpoint: Any,
) -> None:
    publisher.create_topic(name=TOPIC)
    for name, write_metadata in (("raw-metadata", True), ("raw-plain", False)):
        subscriber.create_subscription(
            request={
                "name": f"{PROJECT}/subscriptions/{name}",
                "topic": TOPIC,
                "push_config": {
                    "push_endpoint": f"{push_endpoint.url}?{name}",
                    "no_wrapper": {"write_metadata": write_metadata},
                },
            }
        )
    message_id = publisher.publish(TOPIC, b"\x00raw bytes\xff", colour="blue").result(timeout=30)
    assert push_endpoint.wait_for(lambda requests: len(requests) >= 2)
    by_path = {request.path: request for request in push_endpoint.requests}
    with_metadata, plain = by_path["/push?raw-metadata"], by_path["/push?raw-plain"]
    assert with_metadata.body == plain.body == b"\x00raw bytes\xff"
    assert with_metadata.headers["colour"] == "blue"
    assert with_metadata.headers["x-goog-pubsub-message-id"] == message_id
    assert with_metadata.headers["x-goog-pubsub-subscription-name"] == f"{PROJECT}/subscriptions/raw-metadata"
    assert with_metadata.headers["x-goog-pubsub-publish-time"].endswith("Z")
    assert "colour" not in plain.headers and "x-goog-pubsub-message-id" not in plain.headers


def test_push_and_pull_switch_both_ways(
    server: LocalServer,
    publisher: pubsub_v1.PublisherClient,
    subscriber: pubsub_v1.SubscriberClient,
    push_endpoint: Any,
) -> None:
    publisher.create_topic(name=TOPIC)
    push_endpoint.status = 500  # refuses everything: the message stays unacknowledged
    subscriber.create_subscription(
        request={"name": SUBSCRIPTION, "topic": TOPIC, "push_config": {"push_endpoint": push_endpoint.url}}
    )
    with pytest.raises(exceptions.FailedPrecondition, match="not supported for push subscriptions"):
        subscriber.pull(subscription=SUBSCRIPTION, max_messages=1, timeout=30)
    publisher.publish(TOPIC, b"first").result(timeout=30)
    assert push_endpoint.wait_for(lambda requests: len(requests) >= 1)

    # ModifyPushConfig with an empty config: a pull subscription, holding what push could not deliver.
    subscriber.modify_push_config(subscription=SUBSCRIPTION, push_config={})
    assert subscriber.get_subscription(subscription=SUBSCRIPTION).push_config.push_endpoint == ""
    pulled = subscriber.pull(subscription=SUBSCRIPTION, max_messages=5, timeout=30).received_messages
    assert [received.message.data for received in pulled] == [b"first"]
    subscriber.acknowledge(subscription=SUBSCRIPTION, ack_ids=[pulled[0].ack_id])

    # UpdateSubscription makes it push again.
    push_endpoint.status = 200
    seen = len(push_endpoint.requests)
    subscriber.update_subscription(
        request={
            "subscription": {"name": SUBSCRIPTION, "push_config": {"push_endpoint": push_endpoint.url}},
            "update_mask": {"paths": ["push_config"]},
        }
    )
    publisher.publish(TOPIC, b"second").result(timeout=30)
    assert push_endpoint.wait_for(lambda requests: len(requests) > seen)
    assert base64.b64decode(_bodies(push_endpoint)[-1]["message"]["data"]) == b"second"
    assert server.wait_until_idle(timeout=10)

    with pytest.raises(exceptions.InvalidArgument, match="push_endpoint"):
        subscriber.modify_push_config(subscription=SUBSCRIPTION, push_config={"push_endpoint": "ftp://x/y"})
    with pytest.raises(exceptions.NotFound):
        subscriber.modify_push_config(
            subscription=f"{PROJECT}/subscriptions/missing", push_config={"push_endpoint": push_endpoint.url}
        )


def test_a_push_subscription_always_shows_its_push_format_version(
    server: LocalServer, publisher: pubsub_v1.PublisherClient, subscriber: pubsub_v1.SubscriberClient
) -> None:
    # The reference: x-goog-version defaults to the API's version on create, is left as it was by a
    # change that omits it, and GetSubscription always returns one for a push subscription.
    def version() -> str | None:
        attributes = subscriber.get_subscription(subscription=SUBSCRIPTION).push_config.attributes
        return dict(attributes).get("x-goog-version")

    endpoint = "http://127.0.0.1:9/push"
    publisher.create_topic(name=TOPIC)
    created = subscriber.create_subscription(
        request={"name": SUBSCRIPTION, "topic": TOPIC, "push_config": {"push_endpoint": endpoint}}
    )
    assert dict(created.push_config.attributes) == {"x-goog-version": "v1"} and version() == "v1"
    # Given, it is kept; then omitted by ModifyPushConfig and by UpdateSubscription, it stays.
    subscriber.modify_push_config(
        subscription=SUBSCRIPTION,
        push_config={"push_endpoint": endpoint, "attributes": {"x-goog-version": "v1beta1"}},
    )
    assert version() == "v1beta1"
    subscriber.modify_push_config(subscription=SUBSCRIPTION, push_config={"push_endpoint": endpoint + "2"})
    assert version() == "v1beta1"
    subscriber.update_subscription(
        request={
            "subscription": {"name": SUBSCRIPTION, "push_config": {"push_endpoint": endpoint}},
            "update_mask": {"paths": ["push_config"]},
        }
    )
    assert version() == "v1beta1"
    # A pull subscription has no push format; made push again, it starts from the default.
    subscriber.modify_push_config(subscription=SUBSCRIPTION, push_config={})
    assert version() is None
    subscriber.modify_push_config(subscription=SUBSCRIPTION, push_config={"push_endpoint": endpoint})
    assert version() == "v1"


def test_a_failing_endpoint_is_backed_off_and_the_message_dead_lettered(
    server: LocalServer,
    publisher: pubsub_v1.PublisherClient,
    subscriber: pubsub_v1.SubscriberClient,
    push_endpoint: Any,
) -> None:
    dead_letters = f"{PROJECT}/topics/dead-letters"
    publisher.create_topic(name=TOPIC)
    publisher.create_topic(name=dead_letters)
    subscriber.create_subscription(name=f"{PROJECT}/subscriptions/dead-letters", topic=dead_letters)
    push_endpoint.status = 500
    subscriber.create_subscription(
        request={
            "name": SUBSCRIPTION,
            "topic": TOPIC,
            "push_config": {"push_endpoint": push_endpoint.url},
            "dead_letter_policy": {"dead_letter_topic": dead_letters, "max_delivery_attempts": 5},
        }
    )
    publisher.publish(TOPIC, b"poison").result(timeout=30)
    assert push_endpoint.wait_for(lambda requests: len(requests) >= 5)
    attempts = [body["deliveryAttempt"] for body in _bodies(push_endpoint)[:5]]
    assert attempts == [1, 2, 3, 4, 5]
    # The push back-off doubles from 100 ms between deliveries to the failing endpoint.
    times = [request.at for request in push_endpoint.requests[:5]]
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    assert all(gap >= expected * 0.9 for gap, expected in zip(gaps, [0.1, 0.2, 0.4, 0.8], strict=True)), gaps
    pulled = subscriber.pull(
        subscription=f"{PROJECT}/subscriptions/dead-letters", max_messages=5, timeout=30
    ).received_messages
    assert [received.message.data for received in pulled] == [b"poison"]
    assert pulled[0].message.attributes["CloudPubSubDeadLetterSourceDeliveryCount"] == "5"


def test_the_retry_policy_spaces_redeliveries(
    server: LocalServer,
    publisher: pubsub_v1.PublisherClient,
    subscriber: pubsub_v1.SubscriberClient,
    push_endpoint: Any,
) -> None:
    publisher.create_topic(name=TOPIC)
    push_endpoint.status = 500
    subscriber.create_subscription(
        request={
            "name": SUBSCRIPTION,
            "topic": TOPIC,
            "push_config": {"push_endpoint": push_endpoint.url},
            "retry_policy": {"minimum_backoff": {"seconds": 1}, "maximum_backoff": {"seconds": 1}},
        }
    )
    publisher.publish(TOPIC, b"later").result(timeout=30)
    assert push_endpoint.wait_for(lambda requests: len(requests) >= 1)
    push_endpoint.status = 200
    assert push_endpoint.wait_for(lambda requests: len(requests) >= 2)
    first, second = push_endpoint.requests[:2]
    assert second.at - first.at >= 0.95  # the retry policy's back-off, not the 100 ms push back-off
    assert server.wait_until_idle(timeout=10)


def test_no_answer_within_the_ack_deadline_is_a_nack(
    push_endpoint: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first push gets no answer for longer than the ack deadline (10 s): the message is pushed again."""
    with LocalServer(in_memory=True) as local:
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", local.address)
        publisher, subscriber = pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
        publisher.create_topic(name=TOPIC)
        push_endpoint.delays = [11.0]
        subscriber.create_subscription(
            request={
                "name": SUBSCRIPTION,
                "topic": TOPIC,
                "ack_deadline_seconds": 10,
                "push_config": {"push_endpoint": push_endpoint.url},
            }
        )
        message_id = publisher.publish(TOPIC, b"slow").result(timeout=30)
        assert push_endpoint.wait_for(lambda requests: len(requests) >= 2, timeout=30)
        first, second = push_endpoint.requests[:2]
        assert json.loads(first.body)["message"]["messageId"] == message_id
        assert json.loads(second.body)["message"]["messageId"] == message_id
        assert second.at - first.at >= 9.9
        assert local.wait_until_idle(timeout=10)
        publisher.stop()
        subscriber.close()


def test_push_subscriptions_refuse_exactly_once_delivery(
    server: LocalServer, publisher: pubsub_v1.PublisherClient, subscriber: pubsub_v1.SubscriberClient
) -> None:
    publisher.create_topic(name=TOPIC)
    with pytest.raises(exceptions.InvalidArgument, match="Exactly-once delivery is not supported for push"):
        subscriber.create_subscription(
            request={
                "name": SUBSCRIPTION,
                "topic": TOPIC,
                "push_config": {"push_endpoint": "http://127.0.0.1:9/push"},
                "enable_exactly_once_delivery": True,
            }
        )


def test_ordering_keys_are_pushed_in_order(
    server: LocalServer, subscriber: pubsub_v1.SubscriberClient, push_endpoint: Any
) -> None:
    """With message ordering, a key's next message is pushed only once the previous one is acknowledged,
    even while the endpoint refuses some of them."""
    publisher = pubsub_v1.PublisherClient(
        publisher_options=pubsub_v1.types.PublisherOptions(enable_message_ordering=True)
    )
    publisher.create_topic(name=TOPIC)
    push_endpoint.status = 500
    subscriber.create_subscription(
        request={
            "name": SUBSCRIPTION,
            "topic": TOPIC,
            "enable_message_ordering": True,
            "push_config": {"push_endpoint": push_endpoint.url},
        }
    )
    for i in range(10):
        publisher.publish(TOPIC, f"{i}".encode(), ordering_key="customer-1")
    publisher.publish(TOPIC, b"other", ordering_key="customer-2").result(timeout=30)
    assert push_endpoint.wait_for(lambda requests: len(requests) >= 3)
    push_endpoint.status = 200
    assert server.wait_until_idle(timeout=30)
    acknowledged = [
        base64.b64decode(body["message"]["data"]).decode()
        for request, body in zip(push_endpoint.requests, _bodies(push_endpoint), strict=True)
        if request.status == 200 and body["message"]["orderingKey"] == "customer-1"
    ]
    assert acknowledged == [str(i) for i in range(10)]
    publisher.stop()


def test_a_redirect_is_not_followed_and_not_an_acknowledgement(
    server: LocalServer,
    publisher: pubsub_v1.PublisherClient,
    subscriber: pubsub_v1.SubscriberClient,
    push_endpoint: Any,
) -> None:
    """Only 102/200/201/202/204 acknowledge: a 302 to a page answering 200 is a nack; no GET follows."""
    publisher.create_topic(name=TOPIC)
    push_endpoint.status = 302
    push_endpoint.location = push_endpoint.url.replace("/push", "/landed")
    subscriber.create_subscription(
        request={"name": SUBSCRIPTION, "topic": TOPIC, "push_config": {"push_endpoint": push_endpoint.url}}
    )
    publisher.publish(TOPIC, b"moved").result(timeout=30)
    assert push_endpoint.wait_for(lambda requests: len(requests) >= 3)  # pushed again: not acknowledged
    assert {request.path for request in push_endpoint.requests} == {"/push"}
    push_endpoint.status, push_endpoint.location = 200, None
    assert server.wait_until_idle(timeout=10)


def test_a_huge_answer_body_is_not_read(
    server: LocalServer,
    publisher: pubsub_v1.PublisherClient,
    subscriber: pubsub_v1.SubscriberClient,
    push_endpoint: Any,
) -> None:
    """An endpoint answering 200 with 256 MiB of body: the message is acknowledged and the server stops
    reading after a small bound (what the endpoint got out is at most the bound plus socket buffers)."""
    publisher.create_topic(name=TOPIC)
    push_endpoint.answer_bytes = 256 * 1024 * 1024
    subscriber.create_subscription(
        request={"name": SUBSCRIPTION, "topic": TOPIC, "push_config": {"push_endpoint": push_endpoint.url}}
    )
    publisher.publish(TOPIC, b"big answer").result(timeout=30)
    assert push_endpoint.wait_for(lambda requests: len(requests) >= 1)
    assert server.wait_until_idle(timeout=10)
    # The server closes the connection once it has read its bound, which ends the endpoint's writing.
    assert push_endpoint.wait_for(lambda requests: push_endpoint.answers_ended >= 1)
    assert push_endpoint.answer_bytes_sent < 32 * 1024 * 1024


@pytest.mark.quickjs
def test_a_message_its_transform_fails_on_is_dead_lettered_and_its_neighbours_pushed(
    server: LocalServer,
    publisher: pubsub_v1.PublisherClient,
    subscriber: pubsub_v1.SubscriberClient,
    push_endpoint: Any,
) -> None:
    # Cutting "abcd😀xyz" after 5 UTF-16 units splits the emoji: that message alone fails its transform.
    cut = "function cut(m) { m.data = m.data.substring(0, 5); return m; }"
    dead_letters = f"{PROJECT}/topics/cut-dead-letters"
    publisher.create_topic(name=TOPIC)
    publisher.create_topic(name=dead_letters)
    subscriber.create_subscription(name=f"{PROJECT}/subscriptions/cut-dead-letters", topic=dead_letters)
    subscriber.create_subscription(
        request={
            "name": SUBSCRIPTION,
            "topic": TOPIC,
            "push_config": {"push_endpoint": push_endpoint.url},
            "message_transforms": [{"javascript_udf": {"code": cut, "function_name": "cut"}}],
            "dead_letter_policy": {"dead_letter_topic": dead_letters, "max_delivery_attempts": 5},
            "retry_policy": {"minimum_backoff": "0.1s", "maximum_backoff": "0.1s"},
        }
    )
    for data in (b"first message", "abcd😀xyz".encode(), b"last message"):
        publisher.publish(TOPIC, data).result(timeout=30)
    assert push_endpoint.wait_for(lambda requests: len(requests) >= 2)
    pulled: list[Any] = []
    deadline = time.monotonic() + 60
    while not pulled and time.monotonic() < deadline:
        pulled = subscriber.pull(
            subscription=f"{PROJECT}/subscriptions/cut-dead-letters", max_messages=5, timeout=30
        ).received_messages
    assert [received.message.data for received in pulled] == ["abcd😀xyz".encode()]
    assert sorted(base64.b64decode(body["message"]["data"]) for body in _bodies(push_endpoint)) == [
        b"first",
        b"last ",
    ]
