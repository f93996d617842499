"""Fault injection through ``LocalServer``: the real services, the real store, the official client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import grpc
import grpc.aio
import pytest

from hedgepub import StatusCode
from hedgepub.server import FaultInjector, FaultRule, LocalServer
from hedgepub.server._methods import METHODS

from ..._pb import PublishRequest, PubsubMessage
from ..conftest import aio_stub, create_topic_and_subscription

TOPIC = "projects/faults/topics/orders"
SUBSCRIPTION = "projects/faults/subscriptions/orders-sub"


@pytest.fixture
def server() -> Iterator[LocalServer]:
    # SQLite in a temporary directory: the store that a Publish commits to.
    with LocalServer(faults=FaultInjector(seed=99)) as running:
        asyncio.run(create_topic_and_subscription(running.address, TOPIC, SUBSCRIPTION, timeout=5))
        yield running


async def _publish(address: str, data: bytes, timeout: float) -> list[str]:
    async with grpc.aio.insecure_channel(address) as channel:
        publish = aio_stub(channel, "Publish")
        request = PublishRequest(topic=TOPIC, messages=[PubsubMessage(data=data)])
        return list((await publish(request, timeout=timeout)).message_ids)


def test_a_publish_cancelled_during_the_injected_delay_stores_nothing(server: LocalServer) -> None:
    # A delay far longer than the test: the call's deadline passes in it, however slow the machine.
    server.faults.set("Publish", FaultRule(latency="60s"))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        asyncio.run(_publish(server.address, b"too late", timeout=0.1))
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The injector counts the call once it has dropped it: nothing of it goes on to the store.
    deadline = time.monotonic() + 30
    while server.faults.counts["Publish"].cancelled_during_delay == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.faults.counts["Publish"].cancelled_during_delay == 1
    assert server.messages(TOPIC) == []

    # The delay comes before the commit, and a patient caller gets its message stored.
    server.faults.set("Publish", FaultRule(latency="400ms"))
    started = time.perf_counter()
    [message_id] = asyncio.run(_publish(server.address, b"patient", timeout=5))
    assert time.perf_counter() - started >= 0.4
    assert [(message.message_id, message.data) for message in server.messages(TOPIC)] == [
        (message_id, b"patient")
    ]


def test_an_injected_publish_error_stores_nothing(server: LocalServer) -> None:
    server.faults.set("Publish", "error=UNAVAILABLE:100%")
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        asyncio.run(_publish(server.address, b"refused", timeout=5))
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert raised.value.details() == "UNAVAILABLE injected on Publish by hedgepub fault injection"
    assert server.messages(TOPIC) == []


def test_latency_mix_through_the_official_client(
    server: LocalServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from google.cloud import pubsub_v1

    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", server.address)
    server.faults.set("Publish", "latency=50%:300ms")
    # One message per batch, so that every message is its own Publish call.
    publisher = pubsub_v1.PublisherClient(batch_settings=pubsub_v1.types.BatchSettings(max_messages=1))
    try:
        started = time.perf_counter()
        futures = [publisher.publish(TOPIC, f"m{n}".encode()) for n in range(30)]
        ids = [future.result(timeout=60) for future in futures]
        elapsed = time.perf_counter() - started
    finally:
        publisher.transport.close()
    counts = server.faults.counts["Publish"]
    assert counts.calls == 30
    assert 5 <= counts.delays.get(0.3, 0) <= 25
    assert elapsed >= 0.3
    assert [message.message_id for message in server.messages(TOPIC)] == sorted(ids, key=int)


async def _call_every_method(address: str) -> dict[str, grpc.StatusCode]:
    codes: dict[str, grpc.StatusCode] = {}
    async with grpc.aio.insecure_channel(address) as channel:
        for name, path in METHODS.items():
            try:
                if name == "StreamingPull":
                    # No request written: a write racing with the injected answer could end the call
                    # with the client's own INTERNAL instead of the server's status.
                    call = channel.stream_stream(path)(timeout=5)
                    while await call.read() is not grpc.aio.EOF:
                        pass
                    if await call.code() != grpc.StatusCode.OK:
                        metadata = grpc.aio.Metadata()
                        raise grpc.aio.AioRpcError(
                            await call.code(), metadata, metadata, await call.details()
                        )
                else:
                    await channel.unary_unary(path)(b"", timeout=5)
            except grpc.aio.AioRpcError as error:
                codes[name] = error.code()
                assert "injected" in (error.details() or ""), (name, error.details())
            else:
                codes[name] = grpc.StatusCode.OK
    return codes


def test_a_rule_on_every_method_of_the_three_services_fires(server: LocalServer) -> None:
    # Each method gets its own rule, with a code no real answer to an empty request would give.
    for name in METHODS:
        server.faults.set(name, FaultRule(latency="1ms", errors={StatusCode.DATA_LOSS: 1.0}))
    codes = asyncio.run(_call_every_method(server.address))
    assert codes == dict.fromkeys(METHODS, grpc.StatusCode.DATA_LOSS)
    counts = server.faults.counts
    assert {name: (counts[name].calls, counts[name].failed, counts[name].delayed) for name in METHODS} == (
        dict.fromkeys(METHODS, (1, 1, 1))
    )
    # Nothing reached the services: the topic still has its one subscription and no message.
    assert server.messages(TOPIC) == []


def test_streaming_pull_can_be_delayed_and_failed_at_open(
    server: LocalServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from google.cloud import pubsub_v1

    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", server.address)
    asyncio.run(_publish(server.address, b"hello", timeout=5))
    # Half the stream opens fail; the client reopens until one, past its 200 ms delay, gets the message.
    server.faults.set("StreamingPull", "latency=200ms;error=UNAVAILABLE:50%")
    subscriber = pubsub_v1.SubscriberClient()
    received: list[bytes] = []

    def callback(message: Any) -> None:
        received.append(message.data)
        message.ack()

    future = subscriber.subscribe(SUBSCRIPTION, callback)
    try:
        deadline = time.monotonic() + 10
        while not received and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        future.cancel()
        subscriber.close()
    assert received == [b"hello"]
    counts = server.faults.counts["StreamingPull"]
    assert counts.calls >= 1
    assert counts.delays[0.2] >= 1


def test_a_call_the_client_cancelled_is_logged_and_counted_as_cancelled(
    server: LocalServer, caplog: pytest.LogCaptureFixture
) -> None:
    # A real client whose deadline (100 ms) is shorter than the injected delay (400 ms): the request log
    # said "Publish OK 104.9 ms" for it; it says the client cancelled, and the counts agree.
    import logging

    server.faults.set("Publish", FaultRule(latency="400ms"))
    with caplog.at_level(logging.DEBUG, logger="hedgepub.server.requests"):
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            asyncio.run(_publish(server.address, b"too late", timeout=0.1))
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 10
        while not any("Publish" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
            time.sleep(0.05)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Publish ")]
    assert lines and all("CANCELLED by the client" in line for line in lines), lines
    assert not any(line.startswith("Publish OK") for line in lines)
    assert server.faults.counts["Publish"].cancelled_during_delay == 1
