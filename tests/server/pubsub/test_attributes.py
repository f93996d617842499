"""Attribute keys: ``googclient_`` is the clients' own prefix and is accepted; other ``goog`` keys are not."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.cloud import pubsub_v1
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from hedgepub.server import LocalServer

from ..._pb import PublishRequest, PubsubMessage, Topic

TOPIC = "projects/test-project/topics/traced"
SUBSCRIPTION = "projects/test-project/subscriptions/traced-sub"


@pytest.mark.parametrize("key", ["googclient_traceparent", "googclient_", "googclient_schema_x"])
def test_googclient_keys_are_accepted(raw: Any, key: str) -> None:
    raw.call("CreateTopic", Topic(name=TOPIC))
    request = PublishRequest(topic=TOPIC, messages=[PubsubMessage(attributes={key: "v"})])
    assert raw.call("Publish", request).message_ids


# The rule ("must not begin with 'goog'") knows no case; only the clients' own lowercase prefix is theirs.
@pytest.mark.parametrize(
    "key",
    ["goog", "googclient", "goog_x", "googleclient_x", "googclient-x", "GOOG", "GOOGfoo", "Goog_x",
     "gOoG", "GOOGCLIENT_traceparent"],
)  # fmt: skip
def test_other_goog_keys_are_refused(raw: Any, key: str) -> None:
    raw.call("CreateTopic", Topic(name=TOPIC))
    request = PublishRequest(topic=TOPIC, messages=[PubsubMessage(attributes={key: "v"})])
    error = raw.error("Publish", request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"key={key}" in error.details()


def _tracing_on() -> None:
    """A real (SDK) tracer provider: without one the client has no trace context to propagate."""
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(TracerProvider())


def test_the_official_client_with_tracing_on_publishes(server: LocalServer) -> None:
    _tracing_on()
    publisher = pubsub_v1.PublisherClient(
        publisher_options=pubsub_v1.types.PublisherOptions(enable_open_telemetry_tracing=True)
    )
    subscriber = pubsub_v1.SubscriberClient()
    try:
        publisher.create_topic(name=TOPIC)
        subscriber.create_subscription(name=SUBSCRIPTION, topic=TOPIC)
        message_id = publisher.publish(TOPIC, b"traced", origin="test").result(timeout=10)
        response = subscriber.pull(subscription=SUBSCRIPTION, max_messages=1, timeout=10)
        (received,) = response.received_messages
        assert received.message.message_id == message_id
        assert received.message.attributes["origin"] == "test"
        # The client put the W3C trace context in an attribute of its own; the server kept it.
        assert received.message.attributes["googclient_traceparent"].startswith("00-")
    finally:
        publisher.stop()
        subscriber.close()
