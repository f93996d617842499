"""Exactly-once delivery: announced on the stream, no redelivery under a valid lease, and acks or modacks
without a valid lease failing per ack ID the way the official clients read it."""

from __future__ import annotations

import asyncio
import queue
import signal
from typing import Any

import grpc
import pytest
from google.api_core import exceptions
from google.cloud import pubsub_v1
from google.cloud.pubsub_v1.subscriber import exceptions as subscriber_exceptions
from google.protobuf import field_mask_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from hedgepub.server import LocalServer, MemoryStore, PubSubCore, ServiceError
from hedgepub.testing.virtual_time import run_virtual

from ..._pb import (
    AcknowledgeRequest,
    ModifyAckDeadlineRequest,
    PubsubMessage,
    Subscription,
    Topic,
    UpdateSubscriptionRequest,
)
from ..conftest import RawClient

PROJECT = "projects/test-project"
TOPIC = f"{PROJECT}/topics/payments"
SUBSCRIPTION = f"{PROJECT}/subscriptions/payments-once"


# ---------------------------------------------------------------- the core, on virtual time
async def make_core(**subscription: Any) -> PubSubCore:
    core = PubSubCore(MemoryStore())
    core.load()
    await core.catalog.create_topic(Topic(name=TOPIC))
    await core.catalog.create_subscription(
        Subscription(name=SUBSCRIPTION, topic=TOPIC, enable_exactly_once_delivery=True, **subscription)
    )
    await core.publishing.publish(TOPIC, [PubsubMessage(data=b"pay")], 10)
    return core


def failures(error: ServiceError) -> dict[str, str]:
    assert error.code.name == "INVALID_ARGUMENT"
    (info,) = error.details
    assert isinstance(info, error_details_pb2.ErrorInfo)
    assert info.reason == "EXACTLY_ONCE_ACKID_FAILURE"
    return dict(info.metadata)


def test_an_ack_after_the_lease_expired_fails_and_a_valid_one_succeeds() -> None:
    async def scenario() -> None:
        core = await make_core(ack_deadline_seconds=30)
        (first,) = await core.consumers.pull(SUBSCRIPTION, 1, 0)
        await asyncio.sleep(31)  # the lease ran out: the message is ready again
        (second,) = await core.consumers.pull(SUBSCRIPTION, 1, 0)
        assert second.message.message_id == first.message.message_id
        with pytest.raises(ServiceError) as caught:
            await core.consumers.acknowledge(SUBSCRIPTION, [first.ack_id])
        assert failures(caught.value) == {first.ack_id: "PERMANENT_FAILURE_INVALID_ACK_ID"}
        with pytest.raises(ServiceError) as caught:
            core.consumers.modify_ack_deadline(SUBSCRIPTION, [first.ack_id, "garbage"], 60)
        assert failures(caught.value) == {
            first.ack_id: "PERMANENT_FAILURE_INVALID_ACK_ID",
            "garbage": "PERMANENT_FAILURE_INVALID_ACK_ID",
        }
        # StreamingPull judges the same and gets the failures back, for its confirmations.
        expired = {first.ack_id: "PERMANENT_FAILURE_INVALID_ACK_ID"}
        assert core.consumers.modify_each(SUBSCRIPTION, [first.ack_id, second.ack_id], [60, 60]) == expired
        assert await core.consumers.acknowledge(SUBSCRIPTION, [first.ack_id], report=False) == expired
        await core.consumers.acknowledge(SUBSCRIPTION, [second.ack_id])
        assert core.is_idle()
        # Acknowledged once: a second ack of the same ID fails too, nothing is delivered again.
        with pytest.raises(ServiceError):
            await core.consumers.acknowledge(SUBSCRIPTION, [second.ack_id])
        assert await core.consumers.pull(SUBSCRIPTION, 1, 0) == []

    run_virtual(scenario())


def test_a_valid_lease_is_never_redelivered_while_extended() -> None:
    async def scenario() -> None:
        core = await make_core(ack_deadline_seconds=10)
        (held,) = await core.consumers.pull(SUBSCRIPTION, 1, 0)
        for _ in range(10):
            await asyncio.sleep(9)
            core.consumers.modify_ack_deadline(SUBSCRIPTION, [held.ack_id], 10)
            assert await core.consumers.pull(SUBSCRIPTION, 1, 0) == []
        await core.consumers.acknowledge(SUBSCRIPTION, [held.ack_id])
        assert core.is_idle()

    run_virtual(scenario())


def test_a_mixed_request_acknowledges_the_valid_ids_and_reports_the_others() -> None:
    async def scenario() -> None:
        core = await make_core()
        (held,) = await core.consumers.pull(SUBSCRIPTION, 1, 0)
        unknown = held.ack_id.split("-")[0] + "-999999"
        with pytest.raises(ServiceError) as caught:
            await core.consumers.acknowledge(SUBSCRIPTION, [held.ack_id, unknown])
        assert failures(caught.value) == {unknown: "PERMANENT_FAILURE_INVALID_ACK_ID"}
        assert core.is_idle()

    run_virtual(scenario())


def test_leases_are_recorded_until_acknowledged_and_a_seek_ends_them() -> None:
    async def scenario() -> None:
        core = await make_core()
        store = core._store
        await core.publishing.publish(TOPIC, [PubsubMessage(data=b"second")], 10)
        first, second = await core.consumers.pull(SUBSCRIPTION, 2, 0)
        assert [ack_id for _, ack_id, _ in store.leases(SUBSCRIPTION)] == [first.ack_id, second.ack_id]
        await core.consumers.acknowledge(SUBSCRIPTION, [first.ack_id])
        assert [ack_id for _, ack_id, _ in store.leases(SUBSCRIPTION)] == [second.ack_id]
        await core.replay.seek(SUBSCRIPTION, 0, None)
        assert store.leases(SUBSCRIPTION) == []
        (again,) = await core.consumers.pull(SUBSCRIPTION, 2, 0)
        assert again.message.data == b"second"

    run_virtual(scenario())


def test_without_exactly_once_unknown_ack_ids_are_ignored() -> None:
    async def scenario() -> None:
        core = PubSubCore(MemoryStore())
        core.load()
        await core.catalog.create_topic(Topic(name=TOPIC))
        await core.catalog.create_subscription(Subscription(name=SUBSCRIPTION, topic=TOPIC))
        await core.consumers.acknowledge(SUBSCRIPTION, ["abcdef01-5"])
        core.consumers.modify_ack_deadline(SUBSCRIPTION, ["abcdef01-5"], 30)
        # Nor is any confirmation due on a stream (None: not even an empty one).
        assert await core.consumers.acknowledge(SUBSCRIPTION, ["abcdef01-5"], report=False) is None
        assert core.consumers.modify_each(SUBSCRIPTION, ["abcdef01-5"], [30]) is None

    run_virtual(scenario())


# ---------------------------------------------------------------- on the wire
def test_the_status_details_reach_a_raw_client(raw: Any) -> None:
    raw.call("CreateTopic", Topic(name=TOPIC))
    raw.call(
        "CreateSubscription", Subscription(name=SUBSCRIPTION, topic=TOPIC, enable_exactly_once_delivery=True)
    )
    error = raw.error("Acknowledge", AcknowledgeRequest(subscription=SUBSCRIPTION, ack_ids=["bad"]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(error)
    assert status is not None
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    assert dict(info.metadata) == {"bad": "PERMANENT_FAILURE_INVALID_ACK_ID"}


def test_the_official_client_acks_with_response(
    server: LocalServer, publisher: pubsub_v1.PublisherClient, subscriber: pubsub_v1.SubscriberClient
) -> None:
    publisher.create_topic(name=TOPIC)
    created = subscriber.create_subscription(
        request={"name": SUBSCRIPTION, "topic": TOPIC, "enable_exactly_once_delivery": True}
    )
    assert created.enable_exactly_once_delivery
    publisher.publish(TOPIC, b"pay-1").result(timeout=10)
    deliveries: queue.Queue[Any] = queue.Queue()
    future = subscriber.subscribe(SUBSCRIPTION, deliveries.put)
    try:
        first = deliveries.get(timeout=10)
        # The client learned from the stream that exactly-once is on: its message carries the flag.
        assert first.exactly_once_enabled
        # Someone else ends the lease (a nack on the same ack ID): the message is delivered again under
        # a new ack ID, and the first ack ID is no longer valid.
        with RawClient(server.address) as raw:
            nack = ModifyAckDeadlineRequest(
                subscription=SUBSCRIPTION, ack_ids=[first.ack_id], ack_deadline_seconds=0
            )
            raw.call("ModifyAckDeadline", nack)
        second = deliveries.get(timeout=10)
        assert second.message_id == first.message_id
        assert second.ack_id != first.ack_id
        with pytest.raises(subscriber_exceptions.AcknowledgeError) as caught:
            first.ack_with_response().result(timeout=10)
        assert caught.value.error_code == subscriber_exceptions.AcknowledgeStatus.INVALID_ACK_ID
        assert (
            second.ack_with_response().result(timeout=10) == subscriber_exceptions.AcknowledgeStatus.SUCCESS
        )
        assert server.wait_until_idle(timeout=10)
    finally:
        future.cancel()
        future.result(timeout=10)


def test_exactly_once_can_be_turned_on_by_update(raw: Any) -> None:
    raw.call("CreateTopic", Topic(name=TOPIC))
    raw.call("CreateSubscription", Subscription(name=SUBSCRIPTION, topic=TOPIC))
    update = UpdateSubscriptionRequest(
        subscription=Subscription(name=SUBSCRIPTION, enable_exactly_once_delivery=True),
        update_mask=field_mask_pb2.FieldMask(paths=["enable_exactly_once_delivery"]),
    )
    assert raw.call("UpdateSubscription", update).enable_exactly_once_delivery
    error = raw.error("Acknowledge", AcknowledgeRequest(subscription=SUBSCRIPTION, ack_ids=["x"]))
    assert "acknowledgement ids" in error.details()


# ---------------------------------------------------------------- over a SIGKILL of `hedgepub serve`
def test_a_lease_outlives_a_sigkill(hedgepub_serve: Any) -> None:
    server = hedgepub_serve()
    publisher, subscriber = pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
    publisher.create_topic(name=TOPIC)
    subscriber.create_subscription(
        request={
            "name": SUBSCRIPTION,
            "topic": TOPIC,
            "enable_exactly_once_delivery": True,
            "ack_deadline_seconds": 120,
        }
    )
    publisher.publish(TOPIC, b"leased").result(timeout=10)
    (held,) = subscriber.pull(subscription=SUBSCRIPTION, max_messages=1, timeout=10).received_messages
    publisher.publish(TOPIC, b"waiting").result(timeout=10)
    publisher.transport.close()
    subscriber.close()
    server.send_signal(signal.SIGKILL)  # nothing is flushed or closed
    server.wait(10)

    hedgepub_serve()
    subscriber = pubsub_v1.SubscriberClient()
    request = {"subscription": SUBSCRIPTION, "max_messages": 10, "return_immediately": True}
    with pytest.warns(DeprecationWarning):
        received = subscriber.pull(request=request, timeout=10).received_messages
    # The lease taken before the kill still holds: only the other message is delivered.
    assert [m.message.data for m in received] == [b"waiting"]
    # And its ack ID is still good (once).
    subscriber.acknowledge(subscription=SUBSCRIPTION, ack_ids=[held.ack_id, received[0].ack_id])
    with pytest.raises(exceptions.InvalidArgument):
        subscriber.acknowledge(subscription=SUBSCRIPTION, ack_ids=[held.ack_id])
    subscriber.close()
