"""``gcloud pubsub message-transforms validate`` and ``test`` against ``hedgepub serve``, and a topic and a
subscription created with ``--message-transforms-file``, and a Cloud Storage subscription created with
gcloud's flags that writes its files. Skipped where gcloud is not installed."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.cloud import pubsub_v1

from .._cli import served_address, terminate
from .test_gcloud import PROJECT, Gcloud, gcloud, serve  # noqa: F401 (fixtures)

REDACT = """function redactSSN(message, metadata) {
  const data = JSON.parse(message.data);
  delete data['ssn'];
  message.data = JSON.stringify(data);
  return message;
}"""


def _write(path: Path, document: object) -> str:
    path.write_text(json.dumps(document))
    return str(path)


@pytest.mark.quickjs
def test_validate_accepts_a_good_udf_and_names_what_is_wrong(gcloud: Gcloud, tmp_path: Path) -> None:  # noqa: F811
    good = _write(tmp_path / "good.json", {"javascriptUdf": {"functionName": "redactSSN", "code": REDACT}})
    gcloud.run("pubsub", "message-transforms", "validate", "--message-transform-file", good)
    bad = _write(tmp_path / "bad.json", {"javascriptUdf": {"functionName": "redact", "code": REDACT}})
    refused = gcloud.run(
        "pubsub", "message-transforms", "validate", "--message-transform-file", bad, check=False
    )
    assert refused.returncode != 0
    assert "no function named 'redact'" in refused.stderr
    syntax = _write(tmp_path / "syntax.json", {"javascriptUdf": {"functionName": "f", "code": "function f("}})
    refused = gcloud.run(
        "pubsub", "message-transforms", "validate", "--message-transform-file", syntax, check=False
    )
    assert "SyntaxError" in refused.stderr


@pytest.mark.quickjs
def test_test_applies_a_file_a_topic_and_a_subscription(gcloud: Gcloud, tmp_path: Path) -> None:  # noqa: F811
    transforms = _write(
        tmp_path / "smt.json",
        [{"javascriptUdf": {"functionName": "redactSSN", "code": REDACT}}],
    )
    message = json.dumps({"name": "ana", "ssn": "123"})
    result = gcloud.json(
        "pubsub",
        "message-transforms",
        "test",
        "--message",
        message,
        "--attribute",
        "k=v",
        "--message-transforms-file",
        transforms,
    )
    # gcloud shows the transformed message with its data decoded.
    assert result == [{"data": json.dumps({"name": "ana"}, separators=(",", ":")), "attributes": {"k": "v"}}]

    gcloud.run("pubsub", "topics", "create", "smt-topic", "--message-transforms-file", transforms)
    gcloud.run(
        "pubsub",
        "subscriptions",
        "create",
        "smt-sub",
        "--topic",
        "smt-topic",
        "--message-transforms-file",
        transforms,
    )
    for flag in ("--topic=smt-topic", "--subscription=smt-sub"):
        result = gcloud.json("pubsub", "message-transforms", "test", "--message", message, flag)
        (step,) = result  # type: ignore[misc]
        assert json.loads(step["data"]) == {"name": "ana"}

    gcloud.run("pubsub", "topics", "publish", "smt-topic", "--message", message)
    pulled = gcloud.json("pubsub", "subscriptions", "pull", "smt-sub", "--auto-ack", "--limit", "1")
    assert json.loads(base64.b64decode(pulled[0]["message"]["data"])) == {"name": "ana"}  # type: ignore[index]

    filtering = _write(
        tmp_path / "filter.json",
        [{"javascriptUdf": {"functionName": "drop", "code": "function drop(m) { return null; }"}}],
    )
    result = gcloud.json(
        "pubsub", "message-transforms", "test", "--message", "x", "--message-transforms-file", filtering
    )
    assert result == [{"filteredMessage": {}}]
    failing = _write(
        tmp_path / "fail.json",
        [{"javascriptUdf": {"functionName": "boom", "code": "function boom(m) { throw new Error('no'); }"}}],
    )
    result = gcloud.json(
        "pubsub", "message-transforms", "test", "--message", "x", "--message-transforms-file", failing
    )
    assert result == [{"failedMessage": {"error": {"code": 3, "message": "boom threw: Error: no"}}}]


@pytest.fixture
def serve_buckets(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """``hedgepub serve --in-memory --buckets-dir DIR``; yields its address and DIR."""
    buckets = tmp_path / "buckets"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hedgepub",
            "serve",
            "--in-memory",
            "--port",
            "0",
            "--buckets-dir",
            str(buckets),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield served_address(process, timeout=30), buckets
    finally:
        terminate(process)


def test_gcloud_creates_a_cloud_storage_subscription_that_writes_files(
    serve_buckets: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    executable = shutil.which("gcloud")
    if executable is None:
        pytest.skip("gcloud interop: `gcloud` is not on PATH")
    address, buckets = serve_buckets
    cli = Gcloud(executable, tmp_path / "gcloud-config", address)
    cli.run("config", "set", "auth/disable_credentials", "true")
    cli.run("config", "set", "api_endpoint_overrides/pubsub", f"http://{address}/")
    cli.run("config", "set", "core/project", PROJECT)
    cli.run("pubsub", "topics", "create", "events")
    refused = cli.run(
        "pubsub",
        "subscriptions",
        "create",
        "bad",
        "--topic",
        "events",
        "--cloud-storage-bucket",
        "gs://b",
        check=False,
    )
    assert refused.returncode != 0 and "Invalid cloud_storage_config.bucket" in refused.stderr
    cli.run(
        "pubsub",
        "subscriptions",
        "create",
        "to-storage",
        "--topic",
        "events",
        "--cloud-storage-bucket",
        "my-bucket",
        "--cloud-storage-file-prefix",
        "logs/",
        "--cloud-storage-file-suffix",
        ".txt",
        "--cloud-storage-max-messages",
        "1000",
    )
    described = cli.json("pubsub", "subscriptions", "describe", "to-storage")
    assert described["cloudStorageConfig"]["state"] == "ACTIVE"  # type: ignore[index]
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", address)
    publisher = pubsub_v1.PublisherClient()
    futures = [
        publisher.publish(f"projects/{PROJECT}/topics/events", f"event {n}".encode()) for n in range(1000)
    ]
    for future in futures:
        future.result(30)
    publisher.stop()
    folder = buckets / "my-bucket" / "logs"
    end = time.monotonic() + 30
    while time.monotonic() < end and not (folder.exists() and any(folder.glob("*.txt"))):
        time.sleep(0.2)
    (written,) = folder.glob("*.txt")
    assert len(written.read_bytes().splitlines()) == 1000
