"""Shared fixtures for the server tests: servers on both stores, raw gRPC calls, official clients."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from google.cloud import pubsub_v1
from google.protobuf import duration_pb2

from hedgepub.server import LocalServer
from hedgepub.server._methods import METHODS, RPCS

from .._cli import CLI, served_address
from .._pb import Subscription, Topic

PROJECT = "projects/test-project"
TOPIC = f"{PROJECT}/topics/orders"
SUBSCRIPTION = f"{PROJECT}/subscriptions/orders-sub"


def duration(seconds: float) -> Any:
    """``seconds`` as a protobuf Duration (whole seconds and nanoseconds, both of the same sign)."""
    whole = int(seconds)
    return duration_pb2.Duration(seconds=whole, nanos=round((seconds - whole) * 1e9))


class RawClient:
    """Calls the server's RPCs with raw protobuf requests, the way a hand-written client would."""

    def __init__(self, address: str) -> None:
        options = [
            ("grpc.max_send_message_length", 30_000_000),
            ("grpc.max_receive_message_length", 30_000_000),
        ]
        self.channel = grpc.insecure_channel(address, options=options)

    def call(self, method: str, request: Any, timeout: float = 10.0) -> Any:
        """Call ``method`` (short name) and return its response; raises ``grpc.RpcError``."""
        stub = self.channel.unary_unary(
            METHODS[method],
            request_serializer=type(request).SerializeToString,
            response_deserializer=RPCS[method].response_class.FromString,
        )
        return stub(request, timeout=timeout)

    def error(self, method: str, request: Any) -> grpc.RpcError:
        """Call ``method`` expecting a failure; return the error."""
        with pytest.raises(grpc.RpcError) as caught:
            self.call(method, request)
        return caught.value

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def aio_stub(channel: grpc.aio.Channel, method: str) -> Any:
    """An asyncio stub of ``method`` (short name, as :meth:`RawClient.call` takes) on ``channel``."""
    return channel.unary_unary(
        METHODS[method],
        request_serializer=lambda message: message.SerializeToString(),
        response_deserializer=RPCS[method].response_class.FromString,
    )


async def create_topic_and_subscription(address: str, topic: str, subscription: str, timeout: float) -> None:
    """Create ``topic`` and ``subscription`` on it through raw gRPC calls, each given ``timeout`` s."""
    async with grpc.aio.insecure_channel(address) as channel:
        await aio_stub(channel, "CreateTopic")(Topic(name=topic), timeout=timeout)
        await aio_stub(channel, "CreateSubscription")(
            Subscription(name=subscription, topic=topic), timeout=timeout
        )


@pytest.fixture(params=["memory", "sqlite"])
def server(
    request: pytest.FixtureRequest, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> Iterator[LocalServer]:
    """A running server on each store, with PUBSUB_EMULATOR_HOST pointing at it."""
    if request.param == "memory":
        local = LocalServer(in_memory=True)
    else:
        local = LocalServer(data_dir=tmp_path / "data")
    with local:
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", local.address)
        yield local


@pytest.fixture
def raw(pubsub_server: LocalServer) -> Iterator[RawClient]:
    """A raw gRPC client of an in-memory server."""
    client = RawClient(pubsub_server.address)
    yield client
    client.close()


@pytest.fixture
def publisher() -> Iterator[pubsub_v1.PublisherClient]:
    """The official publisher client (reads PUBSUB_EMULATOR_HOST)."""
    client = pubsub_v1.PublisherClient()
    yield client
    client.stop()


@pytest.fixture
def subscriber() -> Iterator[pubsub_v1.SubscriberClient]:
    """The official subscriber client (reads PUBSUB_EMULATOR_HOST)."""
    client = pubsub_v1.SubscriberClient()
    yield client
    client.close()


@pytest.fixture
def hedgepub_serve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], Any]]:
    """Start ``hedgepub serve`` (a child process) on one data directory and port, again after a kill;
    each call sets PUBSUB_EMULATOR_HOST and returns the process. Whatever still runs is killed after."""
    if os.name != "posix":
        pytest.skip("the tests kill the server process with POSIX signals")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", f"127.0.0.1:{port}")
    started: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        process = subprocess.Popen(
            [*CLI, "serve", "--port", str(port), "--data-dir", str(tmp_path / "serve-data")],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        started.append(process)
        served_address(process, timeout=20)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(10)
