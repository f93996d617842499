"""Fixtures for the publisher tests: a local server, an admin client of it, and a fresh topic."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from hedgepub.bench import AdminClient
from hedgepub.server import LocalServer

PROJECT = "test-project"
_names = itertools.count()


def _unique_name(kind: str) -> str:
    return f"projects/{PROJECT}/{kind}/{kind[:-1]}-{next(_names)}"


@pytest.fixture
def server(pubsub_server: LocalServer) -> LocalServer:
    """An in-memory local server on an ephemeral port; PUBSUB_EMULATOR_HOST points at it."""
    return pubsub_server


@pytest.fixture
def admin(server: LocalServer) -> Iterator[AdminClient]:
    """Topic, subscription and pull calls against ``server`` (hedgepub's own admin client)."""
    with AdminClient(server.address) as client:
        yield client


@pytest.fixture
def topic(admin: AdminClient) -> str:
    """A fresh topic on the server."""
    name = _unique_name("topics")
    admin.create_topic(name)
    return name


@pytest.fixture
def subscription(admin: AdminClient, topic: str) -> str:
    """A fresh subscription to ``topic``."""
    name = _unique_name("subscriptions")
    admin.create_subscription(name, topic)
    return name
