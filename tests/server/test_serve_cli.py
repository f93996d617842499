"""``hedgepub serve`` as a real subprocess: startup time, the official client through it, clean shutdown."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

import hedgepub

from .._cli import CLI, served_address

pytestmark = pytest.mark.skipif(os.name != "posix", reason="sends POSIX signals to the server process")


class ServeProcess:
    """A ``hedgepub serve`` subprocess; stderr goes to a file so that logging can never block it."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in wait()
        started = time.perf_counter()
        self.process = subprocess.Popen(
            [*CLI, *args], stdout=subprocess.PIPE, stderr=self._log, env=env, start_new_session=True
        )
        self.address = served_address(self.process, timeout=15.0, log_path=log_path)
        self.startup_seconds = time.perf_counter() - started

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float = 10.0) -> int:
        try:
            return self.process.wait(timeout)
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.wait()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[list[ServeProcess]]:
    """Start servers with ``serve[0] = ServeProcess(...)``-like calls; kills any left running."""
    started: list[ServeProcess] = []
    yield started
    for process in started:
        process.kill()


def _start(started: list[ServeProcess], tmp_path: Path, *args: str) -> ServeProcess:
    process = ServeProcess(list(args), tmp_path / f"serve-{len(started)}.log")
    started.append(process)
    return process


def test_official_client_publishes_through_serve_and_sigterm_exits_cleanly(
    serve: list[ServeProcess], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from google.cloud import pubsub_v1

    port = _free_port()
    data_dir = tmp_path / "data"
    server = _start(serve, tmp_path, "-vv", "serve", "--port", str(port), "--data-dir", str(data_dir))
    assert server.address == f"127.0.0.1:{port}"
    # Interpreter start and imports included; the server itself reports its own "ready in" time.
    # A figure to read, not a bound to hold on a loaded machine (benchmarks measure speed).
    print(f"hedgepub serve: export line after {server.startup_seconds:.2f} s")

    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", server.address)
    publisher = pubsub_v1.PublisherClient()
    subscriber = pubsub_v1.SubscriberClient()
    topic = publisher.topic_path("serve-test", "orders")
    subscription = subscriber.subscription_path("serve-test", "orders-sub")
    try:
        publisher.create_topic(name=topic)
        subscriber.create_subscription(name=subscription, topic=topic)
        futures = [publisher.publish(topic, f"order {n}".encode(), origin="test") for n in range(20)]
        message_ids = {future.result(timeout=10) for future in futures}
        assert len(message_ids) == 20
        received = subscriber.pull(subscription=subscription, max_messages=100, timeout=10).received_messages
        assert {message.message.message_id for message in received} <= message_ids
        assert all(message.message.attributes["origin"] == "test" for message in received)
    finally:
        publisher.transport.close()
        subscriber.close()

    assert (data_dir).is_dir() and any(data_dir.iterdir())
    server.process.send_signal(signal.SIGTERM)
    assert server.wait() == 0, server.log()
    log = server.log()
    assert "shutting down" in log
    assert "Traceback" not in log
    # -vv logs every request at debug level.
    assert "Publish OK" in log and "CreateTopic OK" in log


def test_ctrl_c_exits_cleanly_and_faults_apply(
    serve: list[ServeProcess], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from google.api_core import exceptions
    from google.cloud import pubsub_v1

    server = _start(
        serve,
        tmp_path,
        "serve",
        "--port",
        "0",
        "--in-memory",
        "--seed",
        "1",
        "--fault",
        "GetTopic:error=PERMISSION_DENIED:100%",
        "--fault",
        "CreateTopic:latency=200ms",
        "--dedup-hedges",
    )
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", server.address)
    publisher = pubsub_v1.PublisherClient()
    topic = publisher.topic_path("serve-test", "slow")
    try:
        started = time.perf_counter()
        publisher.create_topic(name=topic)
        assert time.perf_counter() - started >= 0.2
        with pytest.raises(exceptions.PermissionDenied, match="injected"):
            publisher.get_topic(topic=topic, retry=None)
    finally:
        publisher.transport.close()
    with hedgepub.PublisherClient() as hedged:  # sends hedgepub-batch-id, which --dedup-hedges reads
        hedged.publish(topic, b"once").result(timeout=10)
    server.process.send_signal(signal.SIGINT)
    assert server.wait() == 0, server.log()
    log = server.log()
    assert "fault injection on GetTopic: error=PERMISSION_DENIED:100%" in log
    assert "fault injection: 2 calls met a rule, 1 delayed, 1 failed" in log
    assert "dedup-hedges on" in log
    assert "dedup-hedges: 1 batches stored, 0 repeated attempts answered" in log
    assert "Traceback" not in log


def test_bad_options_are_usage_errors(tmp_path: Path) -> None:
    runner = CliRunner()
    from hedgepub.cli import main

    result = runner.invoke(main, ["serve", "--fault", "Publsh:latency=5ms"])
    assert result.exit_code == 2
    assert "unknown RPC method 'Publsh'" in result.output

    result = runner.invoke(main, ["serve", "--fault", "Publish:latency=95%:5ms,10%:1s"])
    assert result.exit_code == 2
    assert "more than 100%" in result.output

    result = runner.invoke(main, ["serve", "--in-memory", "--data-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "exclude each other" in result.output

    faults_file = tmp_path / "faults.json"
    faults_file.write_text('{"Publish": {"errors": {"UNAVAILABLE": 3}}}')
    result = runner.invoke(main, ["serve", "--faults-file", str(faults_file)])
    assert result.exit_code == 2
    assert "faults file" in result.output


def test_relay_settings_are_flags_with_their_environment_variables_as_defaults() -> None:
    from hedgepub.cli import main
    from hedgepub.server import ServerOptions

    runner = CliRunner()
    result = runner.invoke(main, ["serve", "--in-memory", "--relay-cpu", "two"])
    assert result.exit_code == 2
    assert "neither a CPU number nor 'any'" in result.output
    result = runner.invoke(main, ["serve", "--in-memory"], env={"HEDGEPUB_RELAY_CPU": "two"})
    assert result.exit_code == 2
    assert "neither a CPU number nor 'any'" in result.output
    result = runner.invoke(main, ["serve", "--in-memory"], env={"HEDGEPUB_RELAY": "thread"})
    assert result.exit_code == 2
    assert "'thread' is not one of 'process', 'loop'" in result.output
    assert ServerOptions().relay == "process"
    assert ServerOptions().relay_cpu is None  # the last CPU the server may use
    with pytest.raises(ValueError, match="relay_cpu"):
        ServerOptions(relay_cpu="two")
    with pytest.raises(ValueError, match="relay must be one of"):
        ServerOptions(relay="thread")


def test_port_in_use_is_a_clear_error(serve: list[ServeProcess], tmp_path: Path) -> None:
    first = _start(serve, tmp_path, "serve", "--port", "0", "--in-memory")
    port = first.address.rsplit(":", 1)[1]
    second = subprocess.run(
        [*CLI, "serve", "--port", port, "--in-memory"], capture_output=True, timeout=15, text=True
    )
    assert second.returncode == 1
    assert f"cannot start the server on 127.0.0.1:{port}" in second.stderr
