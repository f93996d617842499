"""``gcloud pubsub message-transforms validate`` and ``test`` against ``hedgepub serve``, and a topic and a
subscription created with ``--message-transforms-file``. Skipped where gcloud is not installed."""

from __future__ import annotations

import base64
import json
from pathlib import Path

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
