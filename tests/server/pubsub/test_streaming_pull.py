"""StreamingPull through raw gRPC: acks, modacks, deadline changes and flow control on the stream, and the
confirmations of acks and modacks it answers with under exactly-once delivery."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import Any

import pytest

from ..._pb import (
    PublishRequest,
    PubsubMessage,
    PullRequest,
    StreamingPullRequest,
    StreamingPullResponse,
    Subscription,
    Topic,
)

TOPIC = "projects/p/topics/streamed"
SUBSCRIPTION = "projects/p/subscriptions/streamed-sub"


class Stream:
    """One StreamingPull call: requests go in through a queue, responses come out of an iterator."""

    def __init__(self, raw: Any, **first: Any) -> None:
        self._requests: queue.Queue[Any] = queue.Queue()
        self._requests.put(StreamingPullRequest(subscription=SUBSCRIPTION, **first))
        stub = raw.channel.stream_stream(
            "/google.pubsub.v1.Subscriber/StreamingPull",
            request_serializer=StreamingPullRequest.SerializeToString,
            response_deserializer=StreamingPullResponse.FromString,
        )
        self.call = stub(self._iterate(), timeout=20)
        #: Every response read so far.
        self.responses: list[Any] = []

    def _iterate(self) -> Iterator[Any]:
        while (request := self._requests.get()) is not None:
            yield request

    def send(self, **fields: Any) -> None:
        self._requests.put(StreamingPullRequest(**fields))

    def next(self) -> Any:
        """The next response, whole."""
        response = next(self.call)
        self.responses.append(response)
        return response

    def receive(self) -> list[Any]:
        return list(self.next().received_messages)

    def receive_by_data(self, count: int) -> dict[bytes, Any]:
        """Read until ``count`` messages came; the received messages by their data."""
        received: list[Any] = []
        while len(received) < count:
            received += self.receive()
        return {r.message.data: r for r in received}

    def close(self) -> None:
        self._requests.put(None)
        self.call.cancel()


def _create(raw: Any, **subscription: Any) -> Any:
    raw.call("CreateTopic", Topic(name=TOPIC))
    raw.call("CreateSubscription", Subscription(name=SUBSCRIPTION, topic=TOPIC, **subscription))
    return raw


@pytest.fixture
def stream_setup(raw: Any) -> Any:
    return _create(raw)


@pytest.fixture
def exactly_once_setup(raw: Any) -> Any:
    return _create(raw, enable_exactly_once_delivery=True)


def publish(raw: Any, *data: bytes) -> None:
    messages = [PubsubMessage(data=item) for item in data]
    raw.call("Publish", PublishRequest(topic=TOPIC, messages=messages))


def test_acks_and_nacks_sent_on_the_stream(stream_setup: Any) -> None:
    raw = stream_setup
    stream = Stream(raw, stream_ack_deadline_seconds=60)
    try:
        publish(raw, b"keep", b"retry")
        by_data = stream.receive_by_data(2)
        stream.send(
            ack_ids=[by_data[b"keep"].ack_id],
            modify_deadline_ack_ids=[by_data[b"retry"].ack_id],
            modify_deadline_seconds=[0],
        )
        (again,) = stream.receive()
        assert again.message.data == b"retry" and again.ack_id != by_data[b"retry"].ack_id
        stream.send(ack_ids=[again.ack_id], stream_ack_deadline_seconds=120)
    finally:
        stream.close()
    pulled = raw.call(
        "Pull", PullRequest(subscription=SUBSCRIPTION, max_messages=10, return_immediately=True)
    )
    assert list(pulled.received_messages) == []
    # Without exactly-once delivery no confirmation is ever sent: not even with the message redelivered
    # after the nack, which (under exactly-once) comes with the nack's confirmation or after it.
    assert len(stream.responses) >= 2
    for response in stream.responses:
        assert not response.HasField("acknowledge_confirmation")
        assert not response.HasField("modify_ack_deadline_confirmation")
        assert not response.subscription_properties.exactly_once_delivery_enabled


def test_flow_control_on_the_stream(stream_setup: Any) -> None:
    raw = stream_setup
    stream = Stream(raw, stream_ack_deadline_seconds=60, max_outstanding_messages=2)
    try:
        publish(raw, b"1", b"2", b"3")
        first = stream.receive()
        assert len(first) == 2
        stream.send(ack_ids=[first[0].ack_id])
        second = stream.receive()
        assert [r.message.data for r in second] == [b"3"]
    finally:
        stream.close()


def test_mismatched_modify_deadline_lists_end_the_stream(stream_setup: Any) -> None:
    import grpc

    raw = stream_setup
    stream = Stream(raw, stream_ack_deadline_seconds=60)
    try:
        stream.send(modify_deadline_ack_ids=["00000000-1", "00000000-2"], modify_deadline_seconds=[10])
        with pytest.raises(grpc.RpcError) as caught:
            stream.receive()
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        stream.close()


_ACK_FIELDS = ("ack_ids", "invalid_ack_ids", "unordered_ack_ids", "temporary_failed_ack_ids")
_MODACK_FIELDS = ("ack_ids", "invalid_ack_ids", "temporary_failed_ack_ids")


class Confirmed:
    """The confirmations read from a stream: per field set, the ack IDs of every response that carried it."""

    def __init__(self) -> None:
        self.acks: dict[str, list[str]] = {}
        self.modacks: dict[str, list[str]] = {}
        self.messages: list[Any] = []

    def read(self, stream: Stream, acks: int, modacks: int) -> Confirmed:
        """Read responses until ``acks`` and ``modacks`` ack IDs in all were confirmed (the stream's
        timeout fails the test if they never are); keep the messages that came meanwhile."""
        while sum(map(len, self.acks.values())) < acks or sum(map(len, self.modacks.values())) < modacks:
            response = stream.next()
            self.messages += response.received_messages
            for fields, confirmation, merged in (
                (_ACK_FIELDS, response.acknowledge_confirmation, self.acks),
                (_MODACK_FIELDS, response.modify_ack_deadline_confirmation, self.modacks),
            ):
                for field in fields:
                    if ack_ids := list(getattr(confirmation, field)):
                        merged.setdefault(field, []).extend(ack_ids)
        return self


def test_exactly_once_confirms_valid_acks_and_modacks_on_the_stream(exactly_once_setup: Any) -> None:
    raw = exactly_once_setup
    stream = Stream(raw, stream_ack_deadline_seconds=60)
    try:
        publish(raw, b"done", b"slow")
        by_data = {data: received.ack_id for data, received in stream.receive_by_data(2).items()}
        assert stream.responses[0].subscription_properties.exactly_once_delivery_enabled
        stream.send(
            ack_ids=[by_data[b"done"]],
            modify_deadline_ack_ids=[by_data[b"slow"]],
            modify_deadline_seconds=[60],
        )
        confirmed = Confirmed().read(stream, acks=1, modacks=1)
        assert confirmed.acks == {"ack_ids": [by_data[b"done"]]}
        assert confirmed.modacks == {"ack_ids": [by_data[b"slow"]]}
        assert confirmed.messages == []
        # Confirmed means done: the acknowledged message is gone and the extended one still leased.
        pull = PullRequest(subscription=SUBSCRIPTION, max_messages=10, return_immediately=True)
        assert list(raw.call("Pull", pull).received_messages) == []
        stream.send(ack_ids=[by_data[b"slow"]])
        assert Confirmed().read(stream, acks=1, modacks=0).acks["ack_ids"] == [by_data[b"slow"]]
    finally:
        stream.close()


def test_exactly_once_confirms_ended_and_malformed_ack_ids_as_invalid(exactly_once_setup: Any) -> None:
    raw = exactly_once_setup
    stream = Stream(raw, stream_ack_deadline_seconds=60)
    try:
        publish(raw, b"pay")
        (first,) = stream.receive()
        # A nack is a modack too, and confirmed; it ends the lease, so the message comes again under a
        # new ack ID, and the first one is no longer valid (as an expired one is not).
        stream.send(modify_deadline_ack_ids=[first.ack_id], modify_deadline_seconds=[0])
        confirmed = Confirmed().read(stream, acks=0, modacks=1)
        assert confirmed.modacks["ack_ids"] == [first.ack_id]
        while not confirmed.messages:
            confirmed.messages += stream.receive()
        (again,) = confirmed.messages
        assert again.message.message_id == first.message.message_id and again.ack_id != first.ack_id

        unknown = "00000000-999999"
        stream.send(ack_ids=[first.ack_id, "not-an-ack-id", again.ack_id, unknown])
        confirmed = Confirmed().read(stream, acks=4, modacks=0)
        assert confirmed.acks == {
            "ack_ids": [again.ack_id],
            "invalid_ack_ids": [first.ack_id, "not-an-ack-id", unknown],
        }
        # Acknowledged, its ack ID is spent: a modack of it is invalid too. The stream goes on.
        stream.send(modify_deadline_ack_ids=[again.ack_id, "bad"], modify_deadline_seconds=[30, 30])
        confirmed = Confirmed().read(stream, acks=0, modacks=2)
        assert confirmed.modacks == {"invalid_ack_ids": [again.ack_id, "bad"]}
        publish(raw, b"next")
        assert [r.message.data for r in stream.receive()] == [b"next"]
    finally:
        stream.close()
