"""The toolbox commands end to end against the local server: topics, subscriptions, publish, pull."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from hedgepub.cli._admin import EXIT_ALREADY_EXISTS, EXIT_NOT_FOUND, EXIT_UNREACHABLE

from .._cli import CLI

PROJECT = "local-project"
ORDERS = f"projects/{PROJECT}/topics/orders"
PAYMENTS = f"projects/{PROJECT}/topics/payments"
AUDIT = f"projects/{PROJECT}/subscriptions/audit"


@pytest.fixture(autouse=True)
def _default_project(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PUBSUB_PROJECT_ID", raising=False)
    monkeypatch.delenv("GOOGLE_CLOUD_PROJECT", raising=False)


def test_topics_are_created_listed_and_deleted(pubsub_server, hedgepub_cli) -> None:
    created = hedgepub_cli("topics", "create", "orders", PAYMENTS)
    assert created.exit_code == 0, created.output
    assert created.stdout.split() == [
        f"projects/{PROJECT}/topics/orders",
        f"projects/{PROJECT}/topics/payments",
    ]

    listed = hedgepub_cli("topics", "list")
    assert listed.exit_code == 0
    assert sorted(listed.stdout.split()) == [
        f"projects/{PROJECT}/topics/orders",
        f"projects/{PROJECT}/topics/payments",
    ]

    again = hedgepub_cli("topics", "create", "orders")
    assert again.exit_code == EXIT_ALREADY_EXISTS
    assert "already exists" in again.output

    deleted = hedgepub_cli("topics", "delete", "orders", "payments")
    assert deleted.exit_code == 0
    assert hedgepub_cli("topics", "list").stdout == ""

    missing = hedgepub_cli("topics", "delete", "orders")
    assert missing.exit_code == EXIT_NOT_FOUND
    assert "not found" in missing.output


def test_the_project_option_and_variable_choose_the_project(pubsub_server, hedgepub_cli, monkeypatch) -> None:
    assert hedgepub_cli("topics", "create", "orders", "--project", "shop").exit_code == 0
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "shop")
    assert hedgepub_cli("topics", "list").stdout.split() == ["projects/shop/topics/orders"]
    assert hedgepub_cli("topics", "list", "--project", "other").stdout == ""


def test_subscriptions_are_created_listed_and_deleted(pubsub_server, hedgepub_cli) -> None:
    assert hedgepub_cli("topics", "create", "orders").exit_code == 0
    created = hedgepub_cli("subscriptions", "create", "audit", "--topic", "orders", "--ack-deadline", "30")
    assert created.exit_code == 0, created.output
    assert created.stdout.strip() == f"projects/{PROJECT}/subscriptions/audit"

    listed = hedgepub_cli("subscriptions", "list")
    assert listed.stdout.strip() == f"{AUDIT}\t{ORDERS}"

    on_missing_topic = hedgepub_cli("subscriptions", "create", "billing", "--topic", "nothing")
    assert on_missing_topic.exit_code == EXIT_NOT_FOUND
    assert "not found" in on_missing_topic.output

    assert hedgepub_cli("subscriptions", "delete", "audit").exit_code == 0
    assert hedgepub_cli("subscriptions", "list").stdout == ""
    assert hedgepub_cli("subscriptions", "delete", "audit").exit_code == EXIT_NOT_FOUND


def test_published_messages_are_pulled_and_acked(pubsub_server, hedgepub_cli) -> None:
    assert hedgepub_cli("topics", "create", "orders").exit_code == 0
    assert hedgepub_cli("subscriptions", "create", "audit", "--topic", "orders").exit_code == 0

    published = hedgepub_cli(
        "publish", "orders", "héllo", "--attr", "kind=test", "--attr", "n=1", "--count", "3"
    )
    assert published.exit_code == 0, published.output
    message_ids = published.stdout.split()
    assert len(set(message_ids)) == 3
    stored = pubsub_server.messages(f"projects/{PROJECT}/topics/orders")
    assert [message.message_id for message in stored] == message_ids
    assert {message.data for message in stored} == {"héllo".encode()}
    assert all(message.attributes == {"kind": "test", "n": "1"} for message in stored)

    pulled = hedgepub_cli("pull", "audit", "--max", "10", "--ack", "--json")
    assert pulled.exit_code == 0, pulled.output
    messages = [json.loads(line) for line in pulled.stdout.splitlines()]
    assert sorted(message["message_id"] for message in messages) == sorted(message_ids)
    assert all(message["data"] == "héllo" for message in messages)
    assert all(message["attributes"] == {"kind": "test", "n": "1"} for message in messages)

    # acknowledged: nothing is delivered again
    empty = hedgepub_cli("pull", "audit", "--wait", "0.3")
    assert empty.exit_code == 0
    assert empty.stdout == ""
    assert "no messages" in empty.output


def test_pull_prints_id_data_and_attributes_as_text(pubsub_server, hedgepub_cli) -> None:
    assert hedgepub_cli("topics", "create", "orders").exit_code == 0
    assert hedgepub_cli("subscriptions", "create", "audit", "--topic", "orders").exit_code == 0
    message_id = hedgepub_cli("publish", "orders", "one", "--attr", "b=2", "--attr", "a=1").stdout.strip()
    pulled = hedgepub_cli("pull", f"projects/{PROJECT}/subscriptions/audit", "--max", "1")
    assert pulled.stdout == f"{message_id}\tone\ta=1 b=2\n"


def test_the_datas_line_end_does_not_push_the_attributes_onto_a_line_of_their_own(
    pubsub_server, hedgepub_cli
) -> None:
    assert hedgepub_cli("topics", "create", "orders").exit_code == 0
    assert hedgepub_cli("subscriptions", "create", "audit", "--topic", "orders").exit_code == 0
    message_id = hedgepub_cli("publish", "orders", "one\n", "--attr", "a=1").stdout.strip()
    pulled = hedgepub_cli("pull", "audit", "--max", "1")
    assert pulled.stdout == f"{message_id}\tone\ta=1\n"


def test_empty_data_is_refused_before_sending_and_an_existing_subscription_is_named(
    pubsub_server, hedgepub_cli
) -> None:
    assert hedgepub_cli("topics", "create", "orders").exit_code == 0
    empty = hedgepub_cli("publish", "orders", "-")  # the runner's standard input is empty
    assert empty.exit_code == 2 and "the message is empty" in empty.output
    assert hedgepub_cli("subscriptions", "create", "audit", "--topic", "orders").exit_code == 0
    again = hedgepub_cli("subscriptions", "create", "audit", "--topic", "orders")
    assert again.exit_code == EXIT_ALREADY_EXISTS
    assert f"subscription projects/{PROJECT}/subscriptions/audit already exists" in again.output
    assert "or topic" not in again.output


def test_publishing_to_a_missing_topic_exits_with_not_found(pubsub_server, hedgepub_cli) -> None:
    result = hedgepub_cli("publish", "nothing", "data")
    assert result.exit_code == EXIT_NOT_FOUND
    assert "not found" in result.output
    assert f"projects/{PROJECT}/topics/nothing" in result.output


def test_pulling_from_a_missing_subscription_exits_with_not_found(pubsub_server, hedgepub_cli) -> None:
    result = hedgepub_cli("pull", "nothing")
    assert result.exit_code == EXIT_NOT_FOUND
    assert "not found" in result.output


@pytest.mark.parametrize(
    "command",
    [("topics", "list"), ("topics", "create", "orders"), ("publish", "orders", "x"), ("pull", "audit")],
)
def test_an_unreachable_server_exits_quickly_with_its_own_code(hedgepub_cli, closed_port, command) -> None:
    started = time.monotonic()
    result = hedgepub_cli(*command, "--endpoint", f"127.0.0.1:{closed_port}")
    assert result.exit_code == EXIT_UNREACHABLE
    assert f"cannot reach a Pub/Sub server at 127.0.0.1:{closed_port}" in result.output
    # Quickly: not after the publisher's 600 s of retries (30 s: room for a loaded machine).
    assert time.monotonic() - started < 30


def test_no_endpoint_is_a_usage_error(hedgepub_cli, monkeypatch) -> None:
    monkeypatch.delenv("PUBSUB_EMULATOR_HOST", raising=False)
    result = hedgepub_cli("topics", "list")
    assert result.exit_code == 2
    assert "PUBSUB_EMULATOR_HOST" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("publish", "orders", "x", "--attr", "novalue"), "KEY=VALUE"),
        (("topics", "create", "projects/p/subscriptions/s"), "projects/<project>/topics/<id>"),
        (("pull", "audit", "--max", "0"), "--max"),
    ],
)
def test_malformed_options_are_usage_errors(hedgepub_cli, args, message) -> None:
    result = hedgepub_cli(*args, "--endpoint", "127.0.0.1:1")
    assert result.exit_code == 2
    assert message in result.output


def test_the_installed_command_reports_errors_by_exit_code(closed_port) -> None:
    completed = subprocess.run(
        [*CLI, "topics", "list"],
        env={"PUBSUB_EMULATOR_HOST": f"127.0.0.1:{closed_port}", "PATH": ""},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert completed.returncode == EXIT_UNREACHABLE
    assert "cannot reach" in completed.stderr
    assert completed.stdout == ""


def test_a_push_subscription_is_created_with_its_endpoint(pubsub_server, hedgepub_cli, push_endpoint) -> None:
    assert hedgepub_cli("topics", "create", "orders").exit_code == 0
    created = hedgepub_cli(
        "subscriptions", "create", "webhook", "--topic", "orders", "--push-endpoint", push_endpoint.url
    )
    assert created.exit_code == 0, created.output
    published = hedgepub_cli("publish", "orders", "hello")
    assert published.exit_code == 0, published.output
    assert push_endpoint.wait_for(lambda requests: len(requests) >= 1)
    body = json.loads(push_endpoint.requests[0].body)
    assert body["subscription"] == f"projects/{PROJECT}/subscriptions/webhook"
    assert body["message"]["messageId"] == published.stdout.split()[0]
    refused = hedgepub_cli(
        "subscriptions", "create", "other", "--topic", "orders", "--push-endpoint", "ftp://x"
    )
    assert refused.exit_code == 1
    assert "push_endpoint" in refused.output
