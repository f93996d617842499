"""``hedgepub serve --iam enforce`` as a real subprocess, with tokens and policy files."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner
from google.pubsub_v1.types import pubsub as types

from hedgepub.cli import main

from .._cli import CLI, served_address, terminate

pytestmark = pytest.mark.skipif(os.name != "posix", reason="stops the server with POSIX signals")

TOKENS = {"t-admin": "user:admin@example.com", "t-ci": "serviceAccount:ci@p.iam.gserviceaccount.com"}
POLICY = {
    "bindings": [
        {"role": "roles/pubsub.admin", "members": ["user:admin@example.com"]},
        {"role": "roles/pubsub.publisher", "members": ["serviceAccount:ci@p.iam.gserviceaccount.com"]},
    ]
}
TOPIC = "projects/cli-project/topics/orders"


def _files(tmp_path: Path, policy: object = POLICY) -> list[str]:
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    policy_file = tmp_path / "policy.json"
    policy_file.write_text(json.dumps(policy))
    return ["--iam", "enforce", "--iam-tokens", str(tokens), "--iam-policy", str(policy_file)]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[str]:
    """A ``hedgepub serve --iam enforce`` process on an ephemeral port; yields its address."""
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        [*CLI, "serve", "--in-memory", "--port", "0", *_files(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=log,
        start_new_session=True,
    )
    try:
        yield served_address(process, timeout=15, log_path=tmp_path / "serve.log")
    finally:
        terminate(process)
        log.close()
    assert "IAM enforcement on" in (tmp_path / "serve.log").read_text()


def test_serve_enforces_the_files_policy(served: str) -> None:
    with grpc.insecure_channel(served) as channel:
        create = channel.unary_unary(
            "/google.pubsub.v1.Publisher/CreateTopic",
            request_serializer=lambda message: message.SerializeToString(),
            response_deserializer=types.Topic.pb().FromString,
        )
        publish = channel.unary_unary(
            "/google.pubsub.v1.Publisher/Publish",
            request_serializer=lambda message: message.SerializeToString(),
            response_deserializer=types.PublishResponse.pb().FromString,
        )
        topic = types.Topic.pb()(name=TOPIC)
        with pytest.raises(grpc.RpcError) as anonymous:
            create(topic, timeout=10)
        assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as publisher_creates:
            create(topic, timeout=10, metadata=[("authorization", "Bearer t-ci")])
        assert publisher_creates.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert publisher_creates.value.details() == "User not authorized to perform this action."
        assert create(topic, timeout=10, metadata=[("authorization", "Bearer t-admin")]).name == TOPIC
        request = types.PublishRequest.pb()(topic=TOPIC, messages=[types.PubsubMessage.pb()(data=b"x")])
        response = publish(request, timeout=10, metadata=[("authorization", "Bearer t-ci")])
        assert len(response.message_ids) == 1


def test_serve_refuses_bad_iam_options_before_starting(tmp_path: Path) -> None:
    runner = CliRunner()
    bad_role = _files(tmp_path, {"bindings": [{"role": "roles/nope", "members": ["user:a@example.com"]}]})
    result = runner.invoke(main, ["serve", "--in-memory", "--port", "0", *bad_role])
    assert result.exit_code == 2
    assert "unknown role 'roles/nope'" in result.output
    result = runner.invoke(main, ["serve", "--in-memory", "--port", "0", "--iam", "enforce"])
    assert result.exit_code == 2
    assert "--iam enforce needs --iam-tokens" in result.output
    tokens = tmp_path / "tokens.json"
    result = runner.invoke(main, ["serve", "--in-memory", "--port", "0", "--iam-tokens", str(tokens)])
    assert result.exit_code == 2
    assert "need --iam enforce" in result.output
    (tmp_path / "broken.json").write_text("{")
    result = runner.invoke(
        main,
        [
            "serve",
            "--in-memory",
            "--port",
            "0",
            "--iam",
            "enforce",
            "--iam-tokens",
            str(tmp_path / "broken.json"),
        ],
    )
    assert result.exit_code == 2
    assert "not valid JSON" in result.output
