"""Message transforms on subscriptions (and topics), with the official client, on both stores: a redaction
UDF, a filtering UDF, a chain, a failing and an endless UDF, zlib, and validation at create and update."""

from __future__ import annotations

import json
import sys
import time
import zlib
from typing import Any

import pytest
from google.api_core import exceptions
from google.cloud import pubsub_v1
from google.protobuf import field_mask_pb2

from hedgepub.server import LocalServer

# return_immediately: an empty answer at once instead of after the server's Pull wait (as test_replay).
pytestmark = pytest.mark.filterwarnings("ignore:The return_immediately flag is deprecated:DeprecationWarning")

PROJECT = "projects/smt-project"
TOPIC = f"{PROJECT}/topics/people"
DEAD = f"{PROJECT}/topics/people-dead"
REDACTED = f"{PROJECT}/subscriptions/redacted"
PLAIN = f"{PROJECT}/subscriptions/plain"
DEAD_SUB = f"{PROJECT}/subscriptions/people-dead-sub"

REDACT = """
function redactSSN(message, metadata) {
  const data = JSON.parse(message.data);
  delete data['ssn'];
  message.data = JSON.stringify(data);
  return message;
}"""
ONLY_ADULTS = """
function onlyAdults(message, metadata) {
  return JSON.parse(message.data).age >= 18 ? message : null;
}"""
STAMP = """
function stamp(message, metadata) {
  message.attributes['redacted-at'] = metadata.message_id;
  return message;
}"""
FAILS = """
function fails(message, metadata) {
  if (message.attributes.bad) throw new Error('cannot handle ' + message.attributes.bad);
  if (message.attributes.spin) { while (true) {} }
  return message;
}"""


def udf(code: str, name: str, disabled: bool = False) -> dict[str, Any]:
    return {"javascript_udf": {"code": code, "function_name": name}, "disabled": disabled}


def person(name: str, age: int) -> bytes:
    return json.dumps({"name": name, "age": age, "ssn": "123-45-6789"}).encode()


def pull_all(subscriber: pubsub_v1.SubscriberClient, subscription: str, count: int) -> list[Any]:
    """Pull (and acknowledge) until ``count`` messages came, or 15 s pass."""
    received: list[Any] = []
    end = time.monotonic() + 15
    while len(received) < count and time.monotonic() < end:
        response = subscriber.pull(subscription=subscription, max_messages=10, timeout=5)
        if response.received_messages:
            subscriber.acknowledge(
                subscription=subscription, ack_ids=[m.ack_id for m in response.received_messages]
            )
        received.extend(response.received_messages)
    return received


def pull_all_once(subscriber: pubsub_v1.SubscriberClient, subscription: str) -> list[Any]:
    """One Pull that returns at once, its messages acknowledged."""
    response = subscriber.pull(subscription=subscription, max_messages=10, timeout=5, return_immediately=True)
    if response.received_messages:
        subscriber.acknowledge(
            subscription=subscription, ack_ids=[m.ack_id for m in response.received_messages]
        )
    else:
        time.sleep(0.2)
    return list(response.received_messages)


@pytest.mark.quickjs
def test_redaction_filter_and_chain_on_a_subscription(
    server: LocalServer, publisher: pubsub_v1.PublisherClient, subscriber: pubsub_v1.SubscriberClient
) -> None:
    publisher.create_topic(name=TOPIC)
    created = subscriber.create_subscription(
        request={
            "name": REDACTED,
            "topic": TOPIC,
            "message_transforms": [
                udf(ONLY_ADULTS, "onlyAdults"),
                udf(REDACT, "redactSSN"),
                udf(STAMP, "stamp"),
            ],
        }
    )
    assert [t.javascript_udf.function_name for t in created.message_transforms] == [
        "onlyAdults",
        "redactSSN",
        "stamp",
    ]
    subscriber.create_subscription(name=PLAIN, topic=TOPIC)
    ids = [
        publisher.publish(TOPIC, person(name, age), kind="person").result(10)
        for name, age in [("ana", 30), ("bo", 12), ("cy", 45)]
    ]

    received = pull_all(subscriber, REDACTED, 2)
    bodies = sorted((json.loads(m.message.data)["name"], m.message) for m in received)
    assert [name for name, _ in bodies] == ["ana", "cy"]
    for _, message in bodies:
        assert "ssn" not in json.loads(message.data)
        assert message.attributes["kind"] == "person"
        assert message.attributes["redacted-at"] == message.message_id
        assert message.message_id in ids
    # The child was filtered out and acknowledged: nothing more comes.
    assert (
        subscriber.pull(
            subscription=REDACTED, max_messages=10, timeout=5, return_immediately=True
        ).received_messages
        == []
    )
    # The subscription without transforms gets the messages as published.
    plain = pull_all(subscriber, PLAIN, 3)
    assert all("ssn" in json.loads(m.message.data) for m in plain)


@pytest.mark.quickjs
def test_failing_and_endless_udfs_dead_letter_the_message_and_nothing_else(
    server: LocalServer, publisher: pubsub_v1.PublisherClient, subscriber: pubsub_v1.SubscriberClient
) -> None:
    publisher.create_topic(name=TOPIC)
    publisher.create_topic(name=DEAD)
    subscriber.create_subscription(name=DEAD_SUB, topic=DEAD)
    subscriber.create_subscription(
        request={
            "name": REDACTED,
            "topic": TOPIC,
            "message_transforms": [udf(FAILS, "fails")],
            "dead_letter_policy": {"dead_letter_topic": DEAD, "max_delivery_attempts": 5},
        }
    )
    for attributes in ({"bad": "this"}, {"spin": "1"}, {"ok": "1"}, {"ok": "2"}):
        publisher.publish(TOPIC, b"payload", **attributes).result(10)
    good = pull_all(subscriber, REDACTED, 2)
    assert sorted(m.message.attributes["ok"] for m in good) == ["1", "2"]
    # Each failure is a delivery attempt (made when a subscriber pulls); after five the original message
    # goes to the dead-letter topic.
    dead: list[Any] = []
    end = time.monotonic() + 30
    while len(dead) < 2 and time.monotonic() < end:
        assert not subscriber.pull(
            subscription=REDACTED, max_messages=10, timeout=5, return_immediately=True
        ).received_messages
        dead.extend(pull_all_once(subscriber, DEAD_SUB))
    assert sorted(
        m.message.attributes.get("bad", "") + m.message.attributes.get("spin", "") for m in dead
    ) == [
        "1",
        "this",
    ]
    assert all(m.message.attributes["CloudPubSubDeadLetterSourceDeliveryCount"] == "5" for m in dead)


@pytest.mark.quickjs
def test_zlib_on_a_subscription_and_disabled_transforms(
    server: LocalServer, publisher: pubsub_v1.PublisherClient, subscriber: pubsub_v1.SubscriberClient
) -> None:
    publisher.create_topic(name=TOPIC)
    compress = {"compression": {"compression_algorithm": "ZLIB", "compression_mode": "COMPRESS"}}
    subscriber.create_subscription(
        request={
            "name": REDACTED,
            "topic": TOPIC,
            "message_transforms": [compress, udf(REDACT, "redactSSN", True)],
        }
    )
    data = person("ana", 30) * 20
    publisher.publish(TOPIC, data).result(10)
    (received,) = pull_all(subscriber, REDACTED, 1)
    assert zlib.decompress(received.message.data) == data  # the disabled redaction did not run


@pytest.mark.quickjs
def test_update_changes_the_transforms_that_apply(
    server: LocalServer, publisher: pubsub_v1.PublisherClient, subscriber: pubsub_v1.SubscriberClient
) -> None:
    publisher.create_topic(name=TOPIC)
    subscriber.create_subscription(name=REDACTED, topic=TOPIC)
    publisher.publish(TOPIC, person("ana", 30)).result(10)
    assert "ssn" in json.loads(pull_all(subscriber, REDACTED, 1)[0].message.data)
    subscriber.update_subscription(
        request={
            "subscription": {"name": REDACTED, "message_transforms": [udf(REDACT, "redactSSN")]},
            "update_mask": field_mask_pb2.FieldMask(paths=["message_transforms"]),
        }
    )
    publisher.publish(TOPIC, person("bo", 40)).result(10)
    assert "ssn" not in json.loads(pull_all(subscriber, REDACTED, 1)[0].message.data)


@pytest.mark.quickjs
@pytest.mark.parametrize(
    ("transform", "reason"),
    [
        (udf("function redactSSN(message) {", "redactSSN"), "SyntaxError"),
        (udf(REDACT, "redact"), "no function named 'redact'"),
    ],
)
def test_invalid_transforms_are_refused_at_create_and_update(
    server: LocalServer,
    publisher: pubsub_v1.PublisherClient,
    subscriber: pubsub_v1.SubscriberClient,
    transform: dict[str, Any],
    reason: str,
) -> None:
    with pytest.raises(exceptions.InvalidArgument, match=reason):
        publisher.create_topic(request={"name": TOPIC, "message_transforms": [transform]})
    publisher.create_topic(name=TOPIC)
    with pytest.raises(exceptions.InvalidArgument, match=reason):
        subscriber.create_subscription(
            request={"name": PLAIN, "topic": TOPIC, "message_transforms": [transform]}
        )
    with pytest.raises(exceptions.InvalidArgument, match="already used"):
        subscriber.create_subscription(
            request={"name": PLAIN, "topic": TOPIC, "message_transforms": [udf(REDACT, "redactSSN")] * 2}
        )
    with pytest.raises(exceptions.InvalidArgument, match=reason):
        publisher.update_topic(
            request={
                "topic": {"name": TOPIC, "message_transforms": [transform]},
                "update_mask": field_mask_pb2.FieldMask(paths=["message_transforms"]),
            }
        )


@pytest.mark.quickjs
def test_topic_transforms_run_at_publish(
    server: LocalServer, publisher: pubsub_v1.PublisherClient, subscriber: pubsub_v1.SubscriberClient
) -> None:
    publisher.create_topic(
        request={
            "name": TOPIC,
            "message_transforms": [udf(ONLY_ADULTS, "onlyAdults"), udf(REDACT, "redactSSN")],
        }
    )
    subscriber.create_subscription(name=PLAIN, topic=TOPIC)
    ids = [publisher.publish(TOPIC, person(name, age)).result(10) for name, age in [("ana", 30), ("bo", 9)]]
    assert len(set(ids)) == 2  # the filtered message gets an ID too
    # Stored as transformed: the child was never stored, and no subscription gets the SSN.
    stored = server.messages(TOPIC)
    assert [json.loads(m.data) for m in stored] == [{"name": "ana", "age": 30}]
    (received,) = pull_all(subscriber, PLAIN, 1)
    assert json.loads(received.message.data) == {"name": "ana", "age": 30}
    assert received.message.message_id == ids[0]


@pytest.mark.quickjs
def test_a_failing_or_endless_topic_udf_fails_the_publish(
    server: LocalServer, publisher: pubsub_v1.PublisherClient, subscriber: pubsub_v1.SubscriberClient
) -> None:
    publisher.create_topic(request={"name": TOPIC, "message_transforms": [udf(FAILS, "fails")]})
    subscriber.create_subscription(name=PLAIN, topic=TOPIC)
    for attributes in ({"bad": "x"}, {"spin": "1"}):
        with pytest.raises(exceptions.InvalidArgument, match="fails threw"):
            publisher.publish(TOPIC, b"payload", **attributes).result(10)
    publisher.publish(TOPIC, b"fine", ok="1").result(10)
    assert [m.data for m in server.messages(TOPIC)] == [b"fine"]


def test_zlib_round_trip_topic_compresses_subscription_decompresses(
    server: LocalServer, publisher: pubsub_v1.PublisherClient, subscriber: pubsub_v1.SubscriberClient
) -> None:
    zlib_mode = lambda mode: {"compression": {"compression_algorithm": "ZLIB", "compression_mode": mode}}  # noqa: E731
    publisher.create_topic(request={"name": TOPIC, "message_transforms": [zlib_mode("COMPRESS")]})
    subscriber.create_subscription(
        request={"name": REDACTED, "topic": TOPIC, "message_transforms": [zlib_mode("DECOMPRESS")]}
    )
    subscriber.create_subscription(name=PLAIN, topic=TOPIC)
    data = b"a line of text that compresses well\n" * 200
    publisher.publish(TOPIC, data).result(10)
    (stored,) = server.messages(TOPIC)
    assert len(stored.data) < len(data) and zlib.decompress(stored.data) == data
    assert pull_all(subscriber, REDACTED, 1)[0].message.data == data
    assert zlib.decompress(pull_all(subscriber, PLAIN, 1)[0].message.data) == data


def test_an_ingestion_topic_reports_its_state(
    server: LocalServer, publisher: pubsub_v1.PublisherClient
) -> None:
    created = publisher.create_topic(
        request={
            "name": TOPIC,
            "ingestion_data_source_settings": {"cloud_storage": {"bucket": "b", "text_format": {}}},
        }
    )
    assert created.state == pubsub_v1.types.Topic.State.INGESTION_RESOURCE_ERROR
    assert publisher.get_topic(topic=TOPIC).state == pubsub_v1.types.Topic.State.INGESTION_RESOURCE_ERROR
    publisher.create_topic(name=PLAIN.replace("subscriptions", "topics"))
    assert publisher.get_topic(topic=PLAIN.replace("subscriptions", "topics")).state == 0


def test_without_quickjs_the_server_runs_and_refuses_a_udf_saying_what_to_install(
    server: LocalServer,
    publisher: pubsub_v1.PublisherClient,
    subscriber: pubsub_v1.SubscriberClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "quickjs", None)  # as where it is not installed
    with pytest.raises(exceptions.FailedPrecondition, match=r"QuickJS.*pip install 'hedgepub\[server\]'"):
        publisher.create_topic(request={"name": TOPIC, "message_transforms": [udf(STAMP, "stamp")]})
    publisher.create_topic(name=TOPIC)
    with pytest.raises(exceptions.FailedPrecondition, match=r"message_transforms\[1\]: JavaScript UDFs"):
        subscriber.create_subscription(
            request={
                "name": PLAIN,
                "topic": TOPIC,
                "message_transforms": [
                    {"compression": {"compression_algorithm": "ZLIB", "compression_mode": "COMPRESS"}},
                    udf(STAMP, "stamp"),
                ],
            }
        )
    subscriber.create_subscription(name=PLAIN, topic=TOPIC)  # anything else works as before
    publisher.publish(TOPIC, b"plain").result(10)
    assert [m.message.data for m in pull_all(subscriber, PLAIN, 1)] == [b"plain"]
