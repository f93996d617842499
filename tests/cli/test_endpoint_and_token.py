"""The toolbox's endpoint forms (one parser with the publisher's rules) and its access token options."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hedgepub.cli._admin import EXIT_FAILED, EXIT_UNREACHABLE, TOKEN_FILE_VARIABLE, TOKEN_VARIABLE
from hedgepub.server import IamConfig, LocalServer

PROJECT = "local-project"


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in ("PUBSUB_PROJECT_ID", "GOOGLE_CLOUD_PROJECT", TOKEN_VARIABLE, TOKEN_FILE_VARIABLE):
        monkeypatch.delenv(variable, raising=False)


@pytest.mark.parametrize("form", ["{address}", "http://{address}", "http://{address}/"])
def test_every_plain_text_form_reaches_the_server(pubsub_server, hedgepub_cli, monkeypatch, form) -> None:
    monkeypatch.delenv("PUBSUB_EMULATOR_HOST")
    endpoint = form.format(address=pubsub_server.address)
    created = hedgepub_cli("topics", "create", "orders", "--endpoint", endpoint)
    assert created.exit_code == 0, created.output
    assert hedgepub_cli("topics", "list", "--endpoint", endpoint).stdout.split() == [
        f"projects/{PROJECT}/topics/orders"
    ]
    published = hedgepub_cli("publish", "orders", "x", "--endpoint", endpoint)
    assert published.exit_code == 0, published.output


@pytest.mark.parametrize(
    "endpoint",
    ["ftp://127.0.0.1:1", "127.0.0.1:port", "http://127.0.0.1:1/v1", "127.0.0.1:99999", "https://"],
)
@pytest.mark.parametrize("command", [("topics", "list"), ("publish", "orders", "x"), ("pull", "audit")])
def test_a_malformed_endpoint_is_a_usage_error_naming_the_forms(hedgepub_cli, endpoint, command) -> None:
    result = hedgepub_cli(*command, "--endpoint", endpoint)
    assert result.exit_code == 2, result.output
    assert "HOST:PORT, http://HOST:PORT (plain text) or https://HOST[:PORT] (TLS)" in result.output


@pytest.mark.parametrize(
    "command",
    [
        ("topics", "list"),
        ("publish", "orders", "x"),
        ("bench", "--topic", "bench", "--yes", "--duration", "2"),
    ],
)
def test_an_endpoint_without_a_port_is_a_usage_error_saying_so(hedgepub_cli, command, tmp_path) -> None:
    # "localhost" meant TLS on 443 and Google credentials: a credentials error that never named the port.
    result = hedgepub_cli(*command, "--endpoint", "localhost")
    assert result.exit_code == 2, result.output
    assert "names no port: give HOST:PORT ('localhost:8085' for a local server or emulator)" in " ".join(
        result.output.split()
    )


def test_https_means_tls_so_a_plain_text_server_is_unreachable(pubsub_server, hedgepub_cli) -> None:
    result = hedgepub_cli(
        "topics", "list", "--endpoint", f"https://{pubsub_server.address}", "--timeout", "2"
    )
    assert result.exit_code == EXIT_UNREACHABLE, result.output


# ------------------------------------------------------------------------------------------- tokens
TOKENS = {"t-admin": "user:admin@example.com", "t-viewer": "user:viewer@example.com"}
POLICY = {
    "bindings": [
        {"role": "roles/pubsub.admin", "members": ["user:admin@example.com"]},
        {"role": "roles/pubsub.viewer", "members": ["user:viewer@example.com"]},
    ]
}


@pytest.fixture
def iam_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalServer]:
    with LocalServer(in_memory=True, iam=IamConfig(TOKENS, POLICY)) as server:
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", server.address)
        yield server


#: Every toolbox command, in an order that works (each needs what the ones before created).
COMMANDS = [
    ("topics", "create", "orders"),
    ("topics", "list"),
    ("subscriptions", "create", "audit", "--topic", "orders"),
    ("subscriptions", "list"),
    ("publish", "orders", "hello"),
    ("pull", "audit", "--ack", "--wait", "1"),
    ("subscriptions", "delete", "audit"),
    ("topics", "delete", "orders"),
]


def test_without_a_token_an_enforcing_server_refuses_every_command(iam_server, hedgepub_cli) -> None:
    result = hedgepub_cli("topics", "list")
    assert result.exit_code == EXIT_FAILED
    assert "missing required authentication credential" in result.output


@pytest.mark.parametrize("how", ["option", "variable", "file option", "file variable"])
def test_every_command_sends_the_token(iam_server, hedgepub_cli, monkeypatch, tmp_path: Path, how) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("t-admin\n", encoding="utf-8")  # as `echo t-admin > token` writes it
    extra: tuple[str, ...] = ()
    if how == "option":
        extra = ("--access-token", "t-admin")
    elif how == "variable":
        monkeypatch.setenv(TOKEN_VARIABLE, "t-admin")
    elif how == "file option":
        extra = ("--access-token-file", str(token_file))
    else:
        monkeypatch.setenv(TOKEN_FILE_VARIABLE, str(token_file))
    for command in COMMANDS:
        result = hedgepub_cli(*command, *extra)
        assert result.exit_code == 0, f"{command}: {result.output}"
        if command[0] == "pull":
            assert "hello" in result.stdout


def test_the_token_goes_over_an_http_endpoint_too(iam_server, hedgepub_cli, monkeypatch) -> None:
    monkeypatch.delenv("PUBSUB_EMULATOR_HOST")
    endpoint = f"http://{iam_server.address}"
    assert (
        hedgepub_cli(
            "topics", "create", "orders", "--endpoint", endpoint, "--access-token", "t-admin"
        ).exit_code
        == 0
    )
    published = hedgepub_cli("publish", "orders", "x", "--endpoint", endpoint, "--access-token", "t-admin")
    assert published.exit_code == 0, published.output
    denied = hedgepub_cli("publish", "orders", "x", "--endpoint", endpoint, "--access-token", "t-viewer")
    assert denied.exit_code == EXIT_FAILED
    assert "not authorized" in denied.output


def test_a_token_with_a_bare_host_port_means_tls_and_the_message_says_so(iam_server, hedgepub_cli) -> None:
    result = hedgepub_cli(
        "topics", "list", "--endpoint", iam_server.address, "--access-token", "t-admin", "--timeout", "2"
    )
    assert result.exit_code == EXIT_UNREACHABLE
    assert "write http://HOST:PORT" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--access-token", "a", "--access-token-file", "f"), "not both"),
        (("--access-token", "two words"), "one word"),
        (("--access-token-file", "/nonexistent/token"), "cannot read /nonexistent/token"),
    ],
)
def test_bad_token_options_are_usage_errors(hedgepub_cli, args, message) -> None:
    result = hedgepub_cli("topics", "list", "--endpoint", "127.0.0.1:1", *args)
    assert result.exit_code == 2, result.output
    assert message in result.output
