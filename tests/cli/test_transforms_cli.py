"""``hedgepub transforms test``: transforms from a YAML or JSON file on a file of messages, offline."""

from __future__ import annotations

import base64
import json
import subprocess
import zlib
from pathlib import Path

from .._cli import CLI

REDACT_YAML = """\
- javascriptUdf:
    functionName: redactSSN
    code: |
      function redactSSN(message, metadata) {
        if (message.attributes.drop) return null;
        const data = JSON.parse(message.data);
        delete data['ssn'];
        message.data = JSON.stringify(data);
        message.attributes.id = metadata.message_id;
        return message;
      }
- compression: {compressionAlgorithm: ZLIB, compressionMode: COMPRESS}
"""


def run(
    tmp_path: Path, transforms: str, messages: list[dict[str, object]], *args: str
) -> tuple[int, list[dict]]:
    (tmp_path / "smt.yaml").write_text(transforms)
    (tmp_path / "messages.jsonl").write_text("".join(json.dumps(message) + "\n" for message in messages))
    completed = subprocess.run(
        [*CLI, "transforms", "test", "--transforms-file", "smt.yaml", "--messages", "messages.jsonl", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = [json.loads(line) for line in completed.stdout.splitlines()]
    return completed.returncode, lines


def test_transformed_filtered_and_failed_messages(tmp_path: Path) -> None:
    code, lines = run(
        tmp_path,
        REDACT_YAML,
        [
            {"data": json.dumps({"name": "ana", "ssn": "1"}), "attributes": {"k": "v"}, "message_id": "m1"},
            {"data": "{}", "attributes": {"drop": "yes"}},
            {"data": "not json"},
        ],
        "--steps",
    )
    assert code == 1  # one message failed
    first, second, third = lines
    assert first["outcome"] == "transformed"
    assert json.loads(zlib.decompress(base64.b64decode(first["data_base64"]))) == {"name": "ana"}
    assert first["attributes"] == {"k": "v", "id": "m1"}
    assert [step["transform"] for step in first["steps"]] == [0, 1]
    assert first["steps"][0]["data"] == '{"name":"ana"}'
    assert second == {"message": 2, "outcome": "filtered", "transform": 0, "steps": [{"transform": 0}]}
    assert third["outcome"] == "failed" and "SyntaxError" in third["error"]


def test_invalid_transforms_are_reported(tmp_path: Path) -> None:
    bad = '[{"javascriptUdf": {"functionName": "f", "code": "function g(m) { return m; }"}}]'
    (tmp_path / "smt.yaml").write_text(bad)
    (tmp_path / "messages.jsonl").write_text('{"data": "x"}\n')
    completed = subprocess.run(
        [*CLI, "transforms", "test", "--transforms-file", "smt.yaml", "--messages", "messages.jsonl"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert completed.returncode == 1
    assert "INVALID_ARGUMENT" in completed.stderr and "no function named 'f'" in completed.stderr
