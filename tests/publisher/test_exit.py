"""A sync client that is never shut down still publishes: at interpreter exit, or once garbage-collected."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
import time

import hedgepub
from hedgepub import BatchSettings, PublisherClient, RetrySettings
from hedgepub.server import FaultRule, LocalServer


def run_child(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter; it inherits PUBSUB_EMULATOR_HOST from the test."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )


def test_a_client_left_open_publishes_before_the_interpreter_exits(server: LocalServer, topic: str) -> None:
    run_child(
        """
        import sys
        from hedgepub import PublisherClient

        publisher = PublisherClient()
        publisher.publish(sys.argv[1], b"left open", origin="child")
        """,
        topic,
    )
    [stored] = server.messages(topic)
    assert (stored.data, stored.attributes) == (b"left open", {"origin": "child"})


def test_the_flush_at_exit_is_bounded_and_leaves_no_future_pending(server: LocalServer, topic: str) -> None:
    # The server would answer after 30 s, within the child's 60 s: an unbounded flush would see the
    # publish answered and print NoneType. ShutdownTimeoutError shows the 0.5 s bound held, with no clock.
    server.faults.set("Publish", FaultRule(latency="100%:30s"))
    child = run_child(
        """
        import atexit
        import sys

        futures = []
        # Registered before hedgepub is imported, so it runs after hedgepub's own exit hook.
        atexit.register(lambda: print(type(futures[0].exception(timeout=0)).__name__))

        import hedgepub._publisher.client
        from hedgepub import PublisherClient

        hedgepub._publisher.client.IMPLICIT_SHUTDOWN_TIMEOUT = 0.5
        publisher = PublisherClient()
        futures.append(publisher.publish(sys.argv[1], b"never answered"))
        """,
        topic,
    )
    assert child.stdout.strip() == "ShutdownTimeoutError"
    assert server.messages(topic) == []


def publisher_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "hedgepub-publisher"]


def test_a_dropped_client_flushes_and_stops_its_thread(server: LocalServer, topic: str) -> None:
    before = len(publisher_threads())
    publisher = PublisherClient(retry_settings=RetrySettings(total_timeout=10))
    future = publisher.publish(topic, b"dropped")
    del publisher
    gc.collect()
    assert future.result(timeout=10)
    deadline = time.monotonic() + 10
    while len(publisher_threads()) > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(publisher_threads()) == before
    assert [stored.data for stored in server.messages(topic)] == [b"dropped"]


def test_a_pending_future_keeps_its_client_alive(server: LocalServer, topic: str) -> None:
    # The official client's one-liner: the client is referenced by nothing but its pending publish.
    before = len(publisher_threads())
    server.faults.set("Publish", FaultRule(latency="100%:200ms"))  # still pending at the collection
    future = hedgepub.PublisherClient().publish(topic, b"one-liner")
    gc.collect()
    assert not future.done()
    message_id = future.result(timeout=10)
    assert [stored.message_id for stored in server.messages(topic)] == [message_id]
    # Once nothing is pending, the client nobody holds is shut down and its thread stops.
    deadline = time.monotonic() + 10
    while len(publisher_threads()) > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(publisher_threads()) == before


def test_the_one_liner_returns_a_message_id(server: LocalServer, topic: str) -> None:
    assert hedgepub.PublisherClient().publish(topic, b"x").result(timeout=10)
    gc.collect()
    futures = [hedgepub.PublisherClient().publish(topic, b"%d" % i) for i in range(3)]
    gc.collect()
    assert len({future.result(timeout=10) for future in futures}) == 3


def test_a_client_connects_at_its_first_publish_not_in_the_flush_at_exit(
    server: LocalServer, topic: str
) -> None:
    # From Python 3.12 the first gRPC channel of a process cannot be opened at interpreter shutdown: a
    # client whose first batch would only be sent by the flush at exit must have connected already.
    # A client that never published has no channel (so it can be inherited by a fork).
    with PublisherClient(batch_settings=BatchSettings(max_latency=60)) as publisher:
        assert not publisher._core.routes.connected
        future = publisher.publish(topic, b"kept open")
        assert publisher._core.routes.connected
        assert not future.done()  # the batch waits for its latency: only the channel was opened
    assert future.result(timeout=10)
