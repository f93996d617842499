"""``hedgepub proxy`` as a real subprocess in front of a real server: the ready line, a publish through it,
its count at a clean SIGTERM shutdown, and bad usage answered with exit code 2."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from google.cloud import pubsub_v1

from hedgepub.cli import main
from hedgepub.cli._exit import EXIT_OK, EXIT_USAGE
from hedgepub.server import LocalServer

from .._cli import CLI, served_address
from .conftest import unique

pytestmark = pytest.mark.skipif(os.name != "posix", reason="sends POSIX signals to the proxy process")


def test_the_proxy_command_forwards_and_reports_at_shutdown(tmp_path: Path) -> None:
    log_path = tmp_path / "proxy.log"
    with LocalServer(in_memory=True) as upstream, open(log_path, "wb") as log:
        process = subprocess.Popen(
            [
                *CLI,
                "proxy",
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                upstream.address,
                "--hedge-delay",
                "0.2",
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,
        )
        try:
            address = served_address(process, timeout=20.0, log_path=log_path)
            os.environ["PUBSUB_EMULATOR_HOST"] = address
            try:
                publisher = pubsub_v1.PublisherClient()
                topic = publisher.create_topic(name=unique("topics")).name
                message_id = publisher.publish(topic, b"through the command").result(timeout=20)
            finally:
                del os.environ["PUBSUB_EMULATOR_HOST"]
            [stored] = upstream.messages(topic)
            assert (stored.message_id, stored.data) == (message_id, b"through the command")
        finally:
            process.send_signal(signal.SIGTERM)
            code = process.wait(20)
    text = log_path.read_text()
    assert code == EXIT_OK, text
    assert f"hedgepub proxy listening on {address}, forwarding to http://{upstream.address}" in text
    assert "hedging after 0.2 s" in text
    assert "proxy: 1 publishes forwarded (1 messages published, 0 failed)" in text


@pytest.mark.parametrize(
    "args",
    [
        ["--listen", "nowhere"],
        ["--upstream", "ftp://example.com"],
        ["--hedge-delay", "soon"],
        ["--hedge-delay", "30"],
        ["--max-tokens", "0"],
        ["--no-hedging", "--hedge-endpoint", "127.0.0.1:1"],
    ],
)
def test_bad_usage_exits_with_2_and_says_why(args: list[str]) -> None:
    result = CliRunner().invoke(main, ["proxy", *args])
    assert result.exit_code == EXIT_USAGE, result.output
    assert "Error" in result.output and "Traceback" not in result.output


def test_google_without_credentials_exits_with_1_and_says_so(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-key.json"
    result = CliRunner().invoke(
        main, ["proxy", "--listen", "127.0.0.1:0"], env={"GOOGLE_APPLICATION_CREDENTIALS": str(missing)}
    )
    assert result.exit_code == 1, result.output
    assert "no credentials for google" in result.output and "Traceback" not in result.output
