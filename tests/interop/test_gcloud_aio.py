"""gcloud-aio-pubsub (an asyncio REST client) publishes and pulls through ``PUBSUB_EMULATOR_HOST``.

The client reads the environment variable and speaks REST/JSON to it: the same address the gRPC
clients use.
"""

from __future__ import annotations

from collections.abc import Iterator

import aiohttp
import pytest
from gcloud.aio.pubsub import PublisherClient, PubsubMessage, SubscriberClient

from hedgepub.server import LocalServer

PROJECT = "projects/aio-interop"
TOPIC = f"{PROJECT}/topics/orders"
SUBSCRIPTION = f"{PROJECT}/subscriptions/orders-sub"


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalServer]:
    with LocalServer(in_memory=True) as local:
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", local.address)
        yield local


async def test_gcloud_aio_pubsub_publishes_and_pulls(server: LocalServer) -> None:
    async with aiohttp.ClientSession() as session:
        publisher = PublisherClient(session=session)
        subscriber = SubscriberClient(session=session)
        await publisher.create_topic(TOPIC)
        await subscriber.create_subscription(SUBSCRIPTION, TOPIC, body={"ackDeadlineSeconds": 20})
        assert (await subscriber.get_subscription(SUBSCRIPTION))["ackDeadlineSeconds"] == 20

        response = await publisher.publish(
            TOPIC, [PubsubMessage(b"first", origin="aio"), PubsubMessage(bytes(range(256)))]
        )
        assert len(response["messageIds"]) == 2
        assert [message.data for message in server.messages(TOPIC)] == [b"first", bytes(range(256))]

        pulled = await subscriber.pull(SUBSCRIPTION, max_messages=10)
        assert [(message.data, message.attributes) for message in pulled] == [
            (b"first", {"origin": "aio"}),
            (bytes(range(256)), None),
        ]
        assert [message.message_id for message in pulled] == response["messageIds"]
        await subscriber.acknowledge(SUBSCRIPTION, [message.ack_id for message in pulled])
        assert server.wait_until_idle(timeout=5)

        assert (await publisher.list_topics(PROJECT))["topics"] == [{"name": TOPIC}]
        await subscriber.delete_subscription(SUBSCRIPTION)
        await publisher.delete_topic(TOPIC)
        assert await publisher.list_topics(PROJECT) == {}
