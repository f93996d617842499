"""Test helpers for users of hedgepub: a pytest plugin that starts the local Pub/Sub server.

Installed as a pytest plugin (entry point ``hedgepub``), so its fixtures are available in any project
that has hedgepub installed::

    def test_publish(pubsub_server):
        # PUBSUB_EMULATOR_HOST points at the server for this test; official clients use it unchanged.
        publisher = pubsub_v1.PublisherClient()
        publisher.create_topic(name="projects/p/topics/events")
        publisher.publish("projects/p/topics/events", b"hi").result()
        assert pubsub_server.messages("projects/p/topics/events")[0].data == b"hi"

pytest imports this module at every start, so the server itself is imported only inside the fixture.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from hedgepub.server import LocalServer


@pytest.fixture
def pubsub_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalServer]:
    """A started in-memory :class:`~hedgepub.server.LocalServer` on an ephemeral port of 127.0.0.1.

    ``PUBSUB_EMULATOR_HOST`` is set to its address for the duration of the test.
    """
    from hedgepub._wire import EMULATOR_HOST_ENV
    from hedgepub.server import LocalServer

    with LocalServer(in_memory=True) as server:
        monkeypatch.setenv(EMULATOR_HOST_ENV, server.address)
        yield server
