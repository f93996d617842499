"""Restart durability: ``kill -9`` the SQLite-backed server while it publishes; nothing acknowledged is lost.

Publishers send batches continuously over raw gRPC and remember every message the server acknowledged
(answered with IDs). The server is killed at a random moment, restarted on the same data directory,
and a subscription created before publishing must then deliver every acknowledged message, with the
same ID. Raw gRPC (rather than the official client) makes "acknowledged" exact: a message counts only if
its Publish call returned.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from ..._cli import CLI, served_address
from ..._pb import (
    AcknowledgeRequest,
    GetSubscriptionRequest,
    PublishRequest,
    PubsubMessage,
    PullRequest,
)
from ..conftest import aio_stub, create_topic_and_subscription

pytestmark = pytest.mark.skipif(os.name != "posix", reason="kills the server process with SIGKILL")

PROJECT = "durability"
TOPIC = f"projects/{PROJECT}/topics/events"
SUBSCRIPTION = f"projects/{PROJECT}/subscriptions/events-sub"


class Server:
    """``hedgepub serve`` on a data directory, in a subprocess that can be killed with SIGKILL."""

    def __init__(self, data_dir: Path, log_path: Path) -> None:
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [*CLI, "serve", "--port", "0", "--data-dir", str(data_dir)],
            stdout=subprocess.PIPE,
            stderr=self._log,
            start_new_session=True,
        )
        self.address = served_address(self.process, timeout=15, log_path=log_path)

    def kill(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(10)
        self._log.close()


async def _publish_until_killed(address: str, acknowledged: dict[str, bytes], publishers: int) -> int:
    """Publish batches from several tasks until the server goes away; return the failed calls."""
    failures = 0
    async with grpc.aio.insecure_channel(address) as channel:
        publish = aio_stub(channel, "Publish")
        counter = iter(range(10**9))

        async def publisher(worker: int) -> None:
            nonlocal failures
            while True:
                datas = [f"w{worker}-m{next(counter)}".encode() for _ in range(random.randint(1, 50))]
                request = PublishRequest(topic=TOPIC, messages=[PubsubMessage(data=data) for data in datas])
                try:
                    response = await publish(request, timeout=5)
                except grpc.aio.AioRpcError:
                    failures += 1
                    return
                assert len(response.message_ids) == len(datas)
                acknowledged.update(zip(response.message_ids, datas, strict=True))

        await asyncio.gather(*(publisher(worker) for worker in range(publishers)))
    return failures


async def _drain(address: str, expected: set[str], timeout: float = 20.0) -> dict[str, bytes]:
    """Pull (and ack) until every ``expected`` ID has arrived or ``timeout`` passes; message ID -> data."""
    received: dict[str, bytes] = {}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    async with grpc.aio.insecure_channel(address) as channel:
        pull = aio_stub(channel, "Pull")
        acknowledge = aio_stub(channel, "Acknowledge")
        while not expected <= received.keys() and loop.time() < deadline:
            response = await pull(PullRequest(subscription=SUBSCRIPTION, max_messages=1000), timeout=10)
            for received_message in response.received_messages:
                received[received_message.message.message_id] = bytes(received_message.message.data)
            if response.received_messages:
                ack_ids = [message.ack_id for message in response.received_messages]
                await acknowledge(AcknowledgeRequest(subscription=SUBSCRIPTION, ack_ids=ack_ids), timeout=10)
    return received


async def _get_subscription(address: str) -> Any:
    async with grpc.aio.insecure_channel(address) as channel:
        return await aio_stub(channel, "GetSubscription")(
            GetSubscriptionRequest(subscription=SUBSCRIPTION), timeout=10
        )


def test_kill_9_while_publishing_loses_no_acknowledged_message(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    log_path = tmp_path / "serve.log"
    rounds = 3
    acknowledged: dict[str, bytes] = {}

    server = Server(data_dir, log_path)
    try:
        asyncio.run(create_topic_and_subscription(server.address, TOPIC, SUBSCRIPTION, timeout=10))
        for round_number in range(rounds):
            kill_after = random.uniform(0.2, 0.6)
            timer = threading.Timer(kill_after, server.kill)
            timer.start()
            before = len(acknowledged)
            started = time.perf_counter()
            asyncio.run(_publish_until_killed(server.address, acknowledged, publishers=4))
            timer.join()
            print(
                f"round {round_number}: killed after {kill_after:.2f} s "
                f"({time.perf_counter() - started:.2f} s), {len(acknowledged) - before} messages acknowledged"
            )
            assert len(acknowledged) > before, "nothing was published before the kill"
            server = Server(data_dir, log_path)
            # Topic and subscription come back with the data.
            assert asyncio.run(_get_subscription(server.address)).topic == TOPIC

        received = asyncio.run(_drain(server.address, set(acknowledged)))
        missing = set(acknowledged) - set(received)
        assert not missing, f"{len(missing)} of {len(acknowledged)} acknowledged messages lost"
        assert {message_id: received[message_id] for message_id in acknowledged} == acknowledged
    finally:
        server.kill()
