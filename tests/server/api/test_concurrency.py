"""Concurrency like Google's emulator: thousands of concurrent gRPC calls and REST connections wait
rather than fail; past the server's bound, calls are refused UNAVAILABLE (which the official clients
retry), never CANCELLED."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections import Counter
from collections.abc import Iterator

import grpc
import grpc.aio
import pytest

from hedgepub.server import LocalServer

from ..._pb import PublishRequest, PublishResponse, PullRequest, PullResponse, Subscription, Topic

TOPIC = "projects/load/topics/many"
SUBSCRIPTION = "projects/load/subscriptions/many-sub"
PUBLISH = "/google.pubsub.v1.Publisher/Publish"


@pytest.fixture
def server() -> Iterator[LocalServer]:
    with LocalServer(in_memory=True) as local:
        with grpc.insecure_channel(local.address) as channel:
            channel.unary_unary("/google.pubsub.v1.Publisher/CreateTopic", Topic.SerializeToString)(
                Topic(name=TOPIC), timeout=30
            )
            channel.unary_unary(
                "/google.pubsub.v1.Subscriber/CreateSubscription", Subscription.SerializeToString
            )(Subscription(name=SUBSCRIPTION, topic=TOPIC), timeout=30)
        yield local


async def _grpc_calls(address: str, calls: int) -> Counter[str]:
    outcomes: Counter[str] = Counter()
    request = PublishRequest(topic=TOPIC, messages=[{"data": b"x"}])
    async with grpc.aio.insecure_channel(address) as channel:
        publish = channel.unary_unary(
            PUBLISH, request_serializer=PublishRequest.SerializeToString,
            response_deserializer=PublishResponse.FromString,
        )  # fmt: skip
        await publish(request, timeout=60)

        async def one() -> None:
            try:
                await publish(request, timeout=120)
            except grpc.aio.AioRpcError as error:
                outcomes[error.code().name] += 1
            else:
                outcomes["OK"] += 1

        await asyncio.gather(*(one() for _ in range(calls)))
    return outcomes


def test_five_thousand_concurrent_grpc_calls_on_one_channel_all_succeed(server: LocalServer) -> None:
    assert asyncio.run(_grpc_calls(server.address, 5000)) == Counter({"OK": 5000})


async def _rest_connections(host: str, port: int, connections: int) -> Counter[str]:
    outcomes: Counter[str] = Counter()
    body = json.dumps({"messages": [{"data": base64.b64encode(b"x").decode()}]}).encode()
    request = (
        f"POST /v1/{TOPIC}:publish HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode() + body

    async def one() -> None:
        try:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(request)
            answer = await asyncio.wait_for(reader.read(), 120)
            writer.close()
        except (OSError, TimeoutError) as error:
            outcomes[type(error).__name__] += 1
            return
        outcomes[answer.split(b" ", 2)[1].decode() if answer else "no answer"] += 1

    await asyncio.gather(*(one() for _ in range(connections)))
    return outcomes


def test_two_thousand_concurrent_rest_connections_all_succeed(server: LocalServer) -> None:
    assert asyncio.run(_rest_connections(server.host, server.port, 2000)) == Counter({"200": 2000})


def test_past_its_bound_the_server_sheds_load_as_unavailable(server: LocalServer) -> None:
    shedder = server._server.shedder
    shedder.limit = 3
    pull = PullRequest(subscription=SUBSCRIPTION, max_messages=1)
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary(
            "/google.pubsub.v1.Subscriber/Pull", PullRequest.SerializeToString, PullResponse.FromString
        )
        waiting = [call.future(pull, timeout=3) for _ in range(3)]  # three Pulls wait for messages
        while shedder.in_progress < 3:
            time.sleep(0.01)
        publish = channel.unary_unary(PUBLISH, PublishRequest.SerializeToString, PublishResponse.FromString)
        with pytest.raises(grpc.RpcError) as refused:
            publish(PublishRequest(topic=TOPIC, messages=[{"data": b"x"}]), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "overloaded" in (refused.value.details() or "")
        assert shedder.shed == 1
        # Over REST the same refusal is a 503.
        outcomes = asyncio.run(_rest_connections(server.host, server.port, 1))
        assert outcomes == Counter({"503": 1})
        shedder.limit = None
        assert publish(PublishRequest(topic=TOPIC, messages=[{"data": b"x"}]), timeout=10).message_ids
        for future in waiting:
            future.result()
    assert shedder.in_progress == 0
