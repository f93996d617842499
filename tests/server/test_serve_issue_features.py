"""Against ``hedgepub serve`` (a child process, as users run it): the official Python client with tracing
on publishes, a filtered ``subscribe()`` receives only what matches, exactly-once ``ack_with_response``
succeeds for a valid lease and fails for a superseded one, and ``create_snapshot`` / ``seek`` replay."""

from __future__ import annotations

import datetime
import os
import queue
from typing import Any

import pytest
from google.cloud import pubsub_v1
from google.cloud.pubsub_v1.subscriber import exceptions as subscriber_exceptions
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from .._pb import ModifyAckDeadlineRequest
from .conftest import RawClient

PROJECT = "projects/serve-test"
TOPIC = f"{PROJECT}/topics/events"
FILTERED = f"{PROJECT}/subscriptions/filtered"
ONCE = f"{PROJECT}/subscriptions/once"


def test_tracing_filters_exactly_once_and_replay_through_serve(hedgepub_serve: Any) -> None:
    hedgepub_serve()
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(TracerProvider())
    publisher = pubsub_v1.PublisherClient(
        publisher_options=pubsub_v1.types.PublisherOptions(enable_open_telemetry_tracing=True)
    )
    subscriber = pubsub_v1.SubscriberClient()
    streams: list[Any] = []
    try:
        publisher.create_topic(name=TOPIC)
        subscriber.create_subscription(
            request={"name": FILTERED, "topic": TOPIC, "filter": "attributes:urgent"}
        )
        subscriber.create_subscription(
            request={
                "name": ONCE,
                "topic": TOPIC,
                "enable_exactly_once_delivery": True,
                "retain_acked_messages": True,
            }
        )
        for data, attributes in ((b"urgent", {"urgent": "1"}), (b"routine", {})):
            publisher.publish(TOPIC, data, **attributes).result(timeout=10)

        filtered: queue.Queue[Any] = queue.Queue()
        streams.append(subscriber.subscribe(FILTERED, filtered.put))
        first = filtered.get(timeout=10)
        assert first.data == b"urgent"
        assert first.attributes["googclient_traceparent"].startswith("00-")  # the client's own key, kept
        first.ack()
        with pytest.raises(queue.Empty):
            filtered.get(timeout=0.5)

        once: queue.Queue[Any] = queue.Queue()
        streams.append(subscriber.subscribe(ONCE, once.put))
        held = [once.get(timeout=10), once.get(timeout=10)]
        # End one lease from outside: its message comes back under a new ack ID; the old one is invalid.
        nacked = held[0]
        with RawClient(os.environ["PUBSUB_EMULATOR_HOST"]) as raw:
            raw.call(
                "ModifyAckDeadline",
                ModifyAckDeadlineRequest(subscription=ONCE, ack_ids=[nacked.ack_id], ack_deadline_seconds=0),
            )
        again = once.get(timeout=10)
        assert again.message_id == nacked.message_id
        with pytest.raises(subscriber_exceptions.AcknowledgeError) as caught:
            nacked.ack_with_response().result(timeout=10)
        assert caught.value.error_code == subscriber_exceptions.AcknowledgeStatus.INVALID_ACK_ID
        for message in (again, held[1]):
            assert (
                message.ack_with_response().result(timeout=10)
                == subscriber_exceptions.AcknowledgeStatus.SUCCESS
            )

        # Replay what was acknowledged (retained): a seek back delivers it again.
        subscriber.create_snapshot(name=f"{PROJECT}/snapshots/now", subscription=ONCE)
        subscriber.seek(
            request={
                "subscription": ONCE,
                "time": datetime.datetime(2001, 1, 1, tzinfo=datetime.UTC),
            }
        )
        replayed = [once.get(timeout=10), once.get(timeout=10)]
        assert sorted(message.data for message in replayed) == [b"routine", b"urgent"]
        # Back to the snapshot, taken when everything was acknowledged: nothing is outstanding again.
        subscriber.seek(request={"subscription": ONCE, "snapshot": f"{PROJECT}/snapshots/now"})
        with pytest.raises(queue.Empty):
            once.get(timeout=1.0)
    finally:
        for stream in streams:
            stream.cancel()
        publisher.stop()
        subscriber.close()
