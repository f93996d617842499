"""The ``gcloud`` CLI against ``hedgepub serve``: topics, subscriptions, publish and pull over REST, in
plain text and over TLS.

gcloud speaks REST/JSON (HTTP/1.1) to ``api_endpoint_overrides/pubsub``; here that is the same port
``hedgepub serve`` prints for gRPC clients. gcloud runs with a configuration directory of its own
(``CLOUDSDK_CONFIG``), credentials off and a project set, exactly as the README tells users to do.
Skipped where gcloud is not installed.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .._cli import first_line, served_address, terminate

PROJECT = "gcloud-interop"
TOPIC = "orders"
SUBSCRIPTION = "orders-sub"


@pytest.fixture
def serve() -> Iterator[str]:
    """``hedgepub serve --in-memory --port 0`` as a subprocess; yields its address."""
    process = subprocess.Popen(
        [sys.executable, "-m", "hedgepub", "serve", "--in-memory", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield served_address(process, timeout=30)
    finally:
        terminate(process)


class Gcloud:
    """Runs gcloud with its own configuration directory."""

    def __init__(self, executable: str, config_dir: Path, address: str) -> None:
        self.executable = executable
        self.address = address
        self.env = {
            **os.environ,
            "CLOUDSDK_CONFIG": str(config_dir),
            "CLOUDSDK_CORE_DISABLE_PROMPTS": "1",
        }

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [self.executable, *args], env=self.env, capture_output=True, text=True, timeout=60
        )
        if check:
            assert result.returncode == 0, (args, result.stdout, result.stderr)
        return result

    def json(self, *args: str) -> object:
        return json.loads(self.run(*args, "--format=json").stdout)


def _rest(address: str, method: str, path: str, body: object = None) -> object:
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        connection.request(method, path, body=None if body is None else json.dumps(body))
        response = connection.getresponse()
        assert response.status == 200
        return json.loads(response.read())
    finally:
        connection.close()


@pytest.fixture
def gcloud(serve: str, tmp_path: Path) -> Gcloud:
    executable = shutil.which("gcloud")
    if executable is None:
        pytest.skip("gcloud interop: `gcloud` is not on PATH")
    cli = Gcloud(executable, tmp_path / "gcloud-config", serve)
    cli.run("config", "set", "auth/disable_credentials", "true")
    cli.run("config", "set", "api_endpoint_overrides/pubsub", f"http://{serve}/")
    cli.run("config", "set", "core/project", PROJECT)
    return cli


def test_gcloud_topics_subscriptions_publish_and_pull(gcloud: Gcloud) -> None:
    topic = f"projects/{PROJECT}/topics/{TOPIC}"
    subscription = f"projects/{PROJECT}/subscriptions/{SUBSCRIPTION}"

    gcloud.run("pubsub", "topics", "create", TOPIC)
    assert [item["name"] for item in gcloud.json("pubsub", "topics", "list")] == [topic]  # type: ignore[union-attr]
    gcloud.run("pubsub", "subscriptions", "create", SUBSCRIPTION, "--topic", TOPIC, "--ack-deadline", "30")
    listed = gcloud.json("pubsub", "subscriptions", "list")
    assert [(item["name"], item["topic"], item["ackDeadlineSeconds"]) for item in listed] == [  # type: ignore[union-attr]
        (subscription, topic, 30)
    ]

    published = gcloud.json("pubsub", "topics", "publish", TOPIC, "--message", "hello", "--attribute", "k=v")
    assert len(published["messageIds"]) == 1  # type: ignore[index]

    pulled = gcloud.json("pubsub", "subscriptions", "pull", SUBSCRIPTION, "--auto-ack", "--limit", "10")
    assert [
        (base64.b64decode(item["message"]["data"]), item["message"]["attributes"])
        for item in pulled  # type: ignore[union-attr]
    ] == [(b"hello", {"k": "v"})]
    assert [item["message"]["messageId"] for item in pulled] == published["messageIds"]  # type: ignore[index, union-attr]
    # --auto-ack acknowledged it: nothing is left. (Asked over REST directly: gcloud's own pull waits
    # for messages, as the real service lets it, which would only slow the test down.)
    pull = {"maxMessages": 10, "returnImmediately": True}
    assert _rest(gcloud.address, "POST", f"/v1/{subscription}:pull", pull) == {}

    gcloud.run("pubsub", "subscriptions", "delete", SUBSCRIPTION)
    gcloud.run("pubsub", "topics", "delete", TOPIC)
    assert _rest(gcloud.address, "GET", f"/v1/projects/{PROJECT}/topics") == {}
    assert _rest(gcloud.address, "GET", f"/v1/projects/{PROJECT}/subscriptions") == {}

    missing = gcloud.run("pubsub", "topics", "describe", TOPIC, check=False)
    assert missing.returncode != 0
    assert "NOT_FOUND: Resource not found (resource=orders)." in missing.stderr


@pytest.fixture
def serve_tls(certificates: Any) -> Iterator[str]:
    """``hedgepub serve --tls-cert ... --tls-key ...`` as a subprocess; yields its ``https://`` endpoint."""
    command = [sys.executable, "-m", "hedgepub", "serve", "--in-memory", "--port", "0"]
    command += ["--tls-cert", str(certificates.cert), "--tls-key", str(certificates.key)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        line = first_line(process, timeout=30)
        assert line.startswith("endpoint=https://"), line
        yield line.removeprefix("endpoint=")
    finally:
        terminate(process)


def test_gcloud_over_tls_trusting_a_private_ca(serve_tls: str, certificates: Any, tmp_path: Path) -> None:
    executable = shutil.which("gcloud")
    if executable is None:
        pytest.skip("gcloud interop: `gcloud` is not on PATH")
    cli = Gcloud(executable, tmp_path / "gcloud-config", serve_tls)
    # gcloud trusts the CA of core/custom_ca_certs_file; the CA bundles some machines name in the
    # environment for every tool would win over it inside gcloud's HTTP library, so they go.
    cli.env["CLOUDSDK_CORE_CUSTOM_CA_CERTS_FILE"] = str(certificates.ca)
    for variable in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"):
        cli.env.pop(variable, None)
    cli.run("config", "set", "auth/disable_credentials", "true")
    cli.run("config", "set", "api_endpoint_overrides/pubsub", f"{serve_tls}/")
    cli.run("config", "set", "core/project", PROJECT)

    cli.run("pubsub", "topics", "create", TOPIC)
    cli.run("pubsub", "subscriptions", "create", SUBSCRIPTION, "--topic", TOPIC)
    published = cli.json("pubsub", "topics", "publish", TOPIC, "--message", "over TLS")
    pulled = cli.json("pubsub", "subscriptions", "pull", SUBSCRIPTION, "--auto-ack", "--limit", "10")
    assert [item["message"]["messageId"] for item in pulled] == published["messageIds"]  # type: ignore[index, union-attr]
    assert [base64.b64decode(item["message"]["data"]) for item in pulled] == [b"over TLS"]  # type: ignore[union-attr]
