"""Failures that speak up: an endpoint that cannot be reached is logged (WARNING once per state change,
naming the endpoint and the status; DEBUG per attempt), stats() shows attempts in flight, a future's
TimeoutError and the errors say what was pending and why, a process that exits without shutdown() is
bounded, and PUBSUB_EMULATOR_HOST takes http:// and https:// as endpoint= does."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable

import pytest

from hedgepub import (
    AsyncPublisherClient,
    HedgingSettings,
    PublisherClient,
    RetrySettings,
    ShutdownTimeoutError,
    StatusCode,
)
from hedgepub._transport.grpc import resolve_endpoint
from hedgepub.admin import AdminClient
from hedgepub.server import LocalServer

TOPIC = "projects/p/topics/orders"


@pytest.fixture
def closed_port() -> int:
    """A port of 127.0.0.1 on which nothing listens (just freed by the OS)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _records(caplog: pytest.LogCaptureFixture, level: int, text: str) -> list[logging.LogRecord]:
    return [
        record
        for record in caplog.records
        if record.name == "hedgepub" and record.levelno == level and text in record.getMessage()
    ]


def _wait_for(condition: Callable[[], object], timeout: float) -> float:
    """Seconds until ``condition()`` held; fails the test after ``timeout``."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            pytest.fail(f"not within {timeout} s")
        time.sleep(0.02)
    return time.monotonic() - start


def test_a_silent_endpoint_is_logged_within_5_s_and_every_failure_says_why(
    closed_port: int, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.DEBUG, logger="hedgepub")
    endpoint = f"127.0.0.1:{closed_port}"
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", endpoint)
    publisher = PublisherClient()
    try:
        future = publisher.publish(TOPIC, b"nobody listens")
        waited = _wait_for(lambda: _records(caplog, logging.WARNING, "cannot reach"), timeout=5)
        [warning] = _records(caplog, logging.WARNING, "cannot reach")
        assert endpoint in warning.getMessage() and "PUBSUB_EMULATOR_HOST" in warning.getMessage()
        assert "UNAVAILABLE" in warning.getMessage()
        print(f"WARNING after {waited:.2f} s")

        # a TimeoutError from the future says what is pending: the batch, its attempts, the endpoint, why
        with pytest.raises(concurrent.futures.TimeoutError) as timed_out:
            future.result(timeout=0.5)
        text = str(timed_out.value)
        assert TOPIC in text and "attempts sent" in text and endpoint in text and "cannot be reached" in text

        _wait_for(lambda: len(_records(caplog, logging.DEBUG, "failed")) >= 2, timeout=10)
        assert len(_records(caplog, logging.WARNING, "cannot reach")) == 1  # once per state change
        stats = publisher.stats().endpoints[endpoint]
        assert stats.reachable is False and "UNAVAILABLE" in (stats.last_error or "")
        assert stats.attempts_failed >= 2
    finally:
        publisher.shutdown(timeout=0.2)
    failed = future.exception()
    assert isinstance(failed, ShutdownTimeoutError)
    assert TOPIC in str(failed) and endpoint in str(failed)


def test_an_endpoint_that_comes_back_is_logged_once_and_the_message_published(
    closed_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="hedgepub")
    retry = RetrySettings(initial_retry_delay=0.05, max_retry_delay=0.5, total_timeout=60)
    with PublisherClient(endpoint=f"http://127.0.0.1:{closed_port}", retry_settings=retry) as publisher:
        future = publisher.publish(TOPIC, b"late")
        _wait_for(lambda: _records(caplog, logging.WARNING, "cannot reach"), timeout=5)
        with LocalServer(in_memory=True, port=closed_port) as server:
            with AdminClient(server.address) as admin:
                admin.create_topic(TOPIC)
            assert future.result(timeout=30)
            [back] = _records(caplog, logging.WARNING, "answers again")
            assert f"127.0.0.1:{closed_port}" in back.getMessage()
            assert [m.data for m in server.messages(TOPIC)] == [b"late"]


def test_a_server_answering_errors_is_reachable_and_logs_each_attempt_at_debug(
    server: LocalServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="hedgepub")
    with AdminClient(server.address) as admin:
        admin.create_topic(TOPIC)
    # UNAVAILABLE is retried until two attempts have been logged (a condition, however slow the
    # machine); then the server answers a code this policy does not retry, which ends the publish.
    endless = RetrySettings(
        initial_retry_delay=0.01,
        max_retry_delay=0.05,
        total_timeout=600,
        retryable_codes={StatusCode.UNAVAILABLE},
    )
    attempts = f"attempt to http://{server.address}"
    with PublisherClient(retry_settings=endless) as publisher:
        publisher.publish(TOPIC, b"connected").result(timeout=30)
        caplog.clear()
        server.faults.set("Publish", "error=UNAVAILABLE:100%")
        future = publisher.publish(TOPIC, b"refused")
        _wait_for(lambda: len(_records(caplog, logging.DEBUG, attempts)) >= 2, timeout=120)
        assert publisher.stats().endpoints[server.address].reachable is True
        server.faults.set("Publish", "error=ABORTED:100%")
        assert "ABORTED" in str(future.exception(timeout=120))
        assert publisher.stats().endpoints[server.address].reachable is True
    logged = _records(caplog, logging.DEBUG, attempts)
    assert len(logged) >= 3 and all("UNAVAILABLE" in r.getMessage() for r in logged[:2])
    # retries that run out of time end in an error naming the status, the topic and the endpoint (the
    # connection opened first: on a loaded machine opening it could take the whole deadline)
    server.faults.clear()
    short = RetrySettings(initial_retry_delay=0.01, max_retry_delay=0.05, total_timeout=1)
    with PublisherClient(retry_settings=short) as publisher:
        _wait_for(lambda: publisher.publish(TOPIC, b"connected").exception(timeout=30) is None, timeout=120)
        server.faults.set("Publish", "error=UNAVAILABLE:100%")
        error = publisher.publish(TOPIC, b"refused").exception(timeout=120)
        assert publisher.stats().endpoints[server.address].reachable is True
    assert "UNAVAILABLE" in str(error) and TOPIC in str(error) and server.address in str(error)
    assert not _records(caplog, logging.WARNING, "cannot reach")


def test_stats_show_the_attempts_in_flight(server: LocalServer) -> None:
    with AdminClient(server.address) as admin:
        admin.create_topic(TOPIC)
    server.faults.set("Publish", "latency=100%:1s")
    with PublisherClient() as publisher:
        future = publisher.publish(TOPIC, b"slow")
        _wait_for(lambda: publisher.stats().attempts_in_flight == 1, timeout=5)
        assert publisher.stats().endpoints[server.address].attempts_in_flight == 1
        future.result(timeout=30)
        assert publisher.stats().attempts_in_flight == 0


@pytest.mark.parametrize("scheme", ["http://", ""])
def test_pubsub_emulator_host_takes_a_scheme_as_endpoint_does(
    server: LocalServer, monkeypatch: pytest.MonkeyPatch, scheme: str
) -> None:
    with AdminClient(server.address) as admin:
        admin.create_topic(TOPIC)
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", scheme + server.address)
    with PublisherClient() as publisher:
        assert publisher.publish(TOPIC, b"x").result(timeout=30)
    secure = resolve_endpoint(environ={"PUBSUB_EMULATOR_HOST": "https://emulator.example:8443"})
    assert (secure.target, secure.secure) == ("emulator.example:8443", True)
    plain = resolve_endpoint(environ={"PUBSUB_EMULATOR_HOST": "emulator.example:443"})
    assert (plain.target, plain.secure) == ("emulator.example:443", False)  # bare: plain text, as always
    with pytest.raises(ValueError, match="PUBSUB_EMULATOR_HOST"):
        resolve_endpoint(environ={"PUBSUB_EMULATOR_HOST": "ftp://emulator.example"})


@pytest.mark.parametrize("client_class", [PublisherClient, AsyncPublisherClient])
def test_an_endpoint_without_a_port_is_refused_saying_so(
    client_class: type[PublisherClient] | type[AsyncPublisherClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    # It meant TLS on port 443, so Application Default Credentials were looked up: DefaultCredentialsError.
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", os.devnull)
    with pytest.raises(ValueError, match=r"endpoint 'localhost' names no port: give HOST:PORT"):
        client_class(endpoint="localhost")
    with pytest.raises(ValueError, match=r"endpoint 'pubsub' names no port"):
        client_class(
            endpoint="http://127.0.0.1:1", hedge_endpoints=["pubsub"], hedging_settings=HedgingSettings()
        )


def test_a_process_exiting_without_shutdown_is_bounded_while_the_endpoint_is_unreachable(
    closed_port: int,
) -> None:
    script = textwrap.dedent(
        f"""
        import logging, time
        import hedgepub
        logging.basicConfig(level=logging.WARNING)
        publisher = hedgepub.PublisherClient()
        future = publisher.publish({TOPIC!r}, b"x")
        time.sleep(1.5)
        print("exiting", flush=True)
        """
    )
    env = {**os.environ, "PUBSUB_EMULATOR_HOST": f"127.0.0.1:{closed_port}"}
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "exiting\n"
        # From the end of the script: at most 5 s of flushing, then the channel's close. Unbounded, the
        # publish would retry for its 600 s; 30 s tells the two apart on however busy a machine (the
        # interpreter's start-up, which a loaded machine slows most, is not counted).
        exiting = time.monotonic()
        _, stderr = child.communicate(timeout=60)
        after_the_script = time.monotonic() - exiting
    finally:
        child.kill()
        child.wait()
    assert child.returncode == 0, stderr
    assert "at most 5 s more" in stderr
    assert after_the_script < 30, (after_the_script, stderr)
