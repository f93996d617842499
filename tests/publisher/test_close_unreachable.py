"""Closing a client whose endpoint was never reached is bounded: leaving ``with PublisherClient(...)`` on
a closed port fails the pending messages with UNAVAILABLE after ``UNREACHABLE_CLOSE_TIMEOUT`` instead of
retrying them for the ten-minute total timeout; an endpoint that answered before keeps the full flush."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from google.api_core import exceptions as google_exceptions

from hedgepub import AsyncPublisherClient, PublisherClient, PublishTimeoutError, RetrySettings, StatusCode
from hedgepub._publisher.closing import UNREACHABLE_CLOSE_TIMEOUT
from hedgepub.admin import AdminClient
from hedgepub.server import LocalServer

TOPIC = "projects/p/topics/orders"


@pytest.fixture
def closed_port() -> int:
    """A port of 127.0.0.1 on which nothing listens (just freed by the OS)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_leaving_with_on_a_closed_port_fails_the_messages_with_unavailable_at_the_bound(
    closed_port: int,
) -> None:
    script = textwrap.dedent(
        f"""
        import hedgepub
        with hedgepub.PublisherClient(endpoint="127.0.0.1:{closed_port}") as publisher:
            futures = [publisher.publish({TOPIC!r}, data) for data in (b"x", b"y")]
        for future in futures:
            error = future.exception(timeout=0)
            print(type(error).__name__, error.code.name, error)
        """
    )
    env = {key: value for key, value in os.environ.items() if key != "PUBSUB_EMULATOR_HOST"}
    started = time.monotonic()
    # Before: the with block's shutdown() waited for the 600 s total timeout (the child was killed at 60 s).
    completed = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    elapsed = time.monotonic() - started
    assert completed.returncode == 0, completed.stderr
    lines = completed.stdout.splitlines()
    assert len(lines) == 2
    for line in lines:
        assert line.startswith("ServiceUnavailable UNAVAILABLE UNAVAILABLE: "), line
        assert f"never reached http://127.0.0.1:{closed_port}" in line
        assert f"shutdown gave up after {UNREACHABLE_CLOSE_TIMEOUT:g} s" in line
    # The bound is the behaviour (the messages above say shutdown gave up after it): the child's whole
    # run, its interpreter's start and imports included, is checked generously, as a loaded machine may
    # take many seconds to start Python and grpc; the 600 s it waited before would still fail here.
    assert elapsed < UNREACHABLE_CLOSE_TIMEOUT + 40, (elapsed, completed.stderr)


def test_the_async_client_is_bounded_alike(closed_port: int) -> None:
    async def scenario() -> BaseException | None:
        async with AsyncPublisherClient(endpoint=f"127.0.0.1:{closed_port}") as publisher:
            pending = asyncio.ensure_future(publisher.publish(TOPIC, b"x"))
            await asyncio.sleep(0)  # the publish is added before the block ends
        return pending.exception()

    error = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    assert isinstance(error, google_exceptions.ServiceUnavailable)
    assert error.code is StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    assert "shutdown gave up" in str(error)


def test_an_endpoint_that_answered_before_keeps_the_whole_flush() -> None:
    # A server that goes away after answering may come back (a restart): shutdown() still waits for the
    # retry settings' total timeout, as it always did, past the bound of a never-reached endpoint.
    retry = RetrySettings(total_timeout=UNREACHABLE_CLOSE_TIMEOUT + 2, initial_rpc_timeout=1.0)
    with LocalServer(in_memory=True) as server:
        with AdminClient(server.address) as admin:
            admin.create_topic(TOPIC)
        publisher = PublisherClient(endpoint=server.address, retry_settings=retry)
        assert publisher.publish(TOPIC, b"answered").result(timeout=30)
    future = publisher.publish(TOPIC, b"after the server went away")
    publisher.shutdown()
    error = future.exception(timeout=0)
    assert isinstance(error, PublishTimeoutError), error
