"""Fixtures for the publisher tests: a local server with a topic, raw admin calls, scripted transports."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.pubsub_v1.types import pubsub

from hedgepub.server import LocalServer

PROJECT = "test-project"
_names = itertools.count()


class Admin:
    """Raw gRPC calls for test setup and read-back (CreateTopic, CreateSubscription, Pull)."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)

    def _call(self, service: str, method: str, request: Any, response_class: Any) -> Any:
        stub = self.channel.unary_unary(
            f"/google.pubsub.v1.{service}/{method}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=response_class.FromString,
        )
        return stub(request, timeout=10)

    def create_topic(self, name: str | None = None) -> str:
        topic = f"projects/{PROJECT}/topics/{name or f'topic-{next(_names)}'}"
        self._call("Publisher", "CreateTopic", pubsub.Topic.pb()(name=topic), pubsub.Topic.pb())
        return topic

    def create_subscription(self, topic: str, ordering: bool = False) -> str:
        name = f"projects/{PROJECT}/subscriptions/sub-{next(_names)}"
        request = pubsub.Subscription.pb()(name=name, topic=topic, enable_message_ordering=ordering)
        self._call("Subscriber", "CreateSubscription", request, pubsub.Subscription.pb())
        return name

    def pull(self, subscription: str, max_messages: int = 1000) -> list[Any]:
        request = pubsub.PullRequest.pb()(subscription=subscription, max_messages=max_messages)
        response = self._call("Subscriber", "Pull", request, pubsub.PullResponse.pb())
        return [received.message for received in response.received_messages]

    def close(self) -> None:
        self.channel.close()


@pytest.fixture
def server(pubsub_server: LocalServer) -> LocalServer:
    """An in-memory local server on an ephemeral port; PUBSUB_EMULATOR_HOST points at it."""
    return pubsub_server


@pytest.fixture
def admin(server: LocalServer) -> Iterator[Admin]:
    """Raw admin calls against ``server``."""
    client = Admin(server.address)
    yield client
    client.close()


@pytest.fixture
def topic(admin: Admin) -> str:
    """A fresh topic on the server."""
    return admin.create_topic()
