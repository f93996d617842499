"""StreamingPull through raw gRPC: acks, modacks, deadline changes and flow control on the stream."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import Any

import pytest

from .._pb import (
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

    def _iterate(self) -> Iterator[Any]:
        while (request := self._requests.get()) is not None:
            yield request

    def send(self, **fields: Any) -> None:
        self._requests.put(StreamingPullRequest(**fields))

    def receive(self) -> list[Any]:
        return list(next(self.call).received_messages)

    def close(self) -> None:
        self._requests.put(None)
        self.call.cancel()


@pytest.fixture
def stream_setup(raw: Any) -> Any:
    raw.call("CreateTopic", Topic(name=TOPIC))
    raw.call("CreateSubscription", Subscription(name=SUBSCRIPTION, topic=TOPIC))
    return raw


def publish(raw: Any, *data: bytes) -> None:
    messages = [PubsubMessage(data=item) for item in data]
    raw.call("Publish", PublishRequest(topic=TOPIC, messages=messages))


def test_acks_and_nacks_sent_on_the_stream(stream_setup: Any) -> None:
    raw = stream_setup
    stream = Stream(raw, stream_ack_deadline_seconds=60)
    try:
        publish(raw, b"keep", b"retry")
        received: list[Any] = []
        while len(received) < 2:
            received += stream.receive()
        by_data = {r.message.data: r for r in received}
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
