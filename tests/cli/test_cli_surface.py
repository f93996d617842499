"""The command line's surface: --version, -v where users type it, exit codes in every --help, the default
project as Google's tools find it, and publish's data from a file or standard input."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import click
import pytest

import hedgepub
from hedgepub.admin import default_project
from hedgepub.cli import main

from .._cli import CLI

TOPIC = "projects/local-project/topics/orders"


@pytest.fixture(autouse=True)
def _default_project(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PUBSUB_PROJECT_ID", raising=False)
    monkeypatch.delenv("GOOGLE_CLOUD_PROJECT", raising=False)


def test_version_is_the_package_version(hedgepub_cli) -> None:
    shown = hedgepub_cli("--version")
    assert shown.exit_code == 0
    assert shown.stdout.strip() == f"hedgepub {hedgepub.__version__}"


def _all_commands() -> list[tuple[str, ...]]:
    context = click.Context(main)
    found: list[tuple[str, ...]] = []
    for name in main.list_commands(context):
        command = main.get_command(context, name)
        if isinstance(command, click.Group):
            found += [(name, sub) for sub in command.commands]
        else:
            found.append((name,))
    return found


@pytest.mark.parametrize("command", _all_commands(), ids=" ".join)
def test_every_command_documents_its_exit_codes_and_takes_verbosity(hedgepub_cli, command) -> None:
    shown = hedgepub_cli(*command, "--help")
    assert shown.exit_code == 0
    text = " ".join(shown.stdout.split())
    assert "Exit codes: 0 " in text
    assert "-v, --verbose" in text
    if command[0] != "publish":
        assert "publish failed" not in text, "only publish can fail to publish"


def test_verbosity_after_the_sub_command_counts_and_grpc_loop_noise_is_dropped(pubsub_server) -> None:
    from hedgepub.admin import AdminClient

    with AdminClient(pubsub_server.address) as admin:
        admin.create_topic(TOPIC)
    completed = subprocess.run(
        [*CLI, "publish", "orders", "hello", "-vv"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PUBSUB_EMULATOR_HOST": pubsub_server.address},
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert " DEBUG " in completed.stderr  # -vv after the sub-command means debug, as before it
    assert "Loaded running loop" not in completed.stderr
    quiet = subprocess.run(
        [*CLI, "publish", "orders", "hello"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PUBSUB_EMULATOR_HOST": pubsub_server.address},
        check=False,
    )
    assert quiet.returncode == 0
    assert quiet.stderr == ""


def _write_gcloud_config(directory: Path, project: str, name: str = "work") -> None:
    (directory / "configurations").mkdir(parents=True)
    (directory / "active_config").write_text(name + "\n")
    (directory / "configurations" / f"config_{name}").write_text(
        f"[core]\naccount = a@example.com\nproject = {project}\n"
    )


def test_the_default_project_is_found_where_google_tools_look(tmp_path: Path) -> None:
    gcloud = tmp_path / "gcloud"
    _write_gcloud_config(gcloud, "from-gcloud")
    environ = {"CLOUDSDK_CONFIG": str(gcloud)}
    assert default_project(environ) == "from-gcloud"
    assert default_project({**environ, "CLOUDSDK_CORE_PROJECT": "from-cloudsdk"}) == "from-cloudsdk"
    assert default_project({**environ, "GOOGLE_CLOUD_PROJECT": "from-adc"}) == "from-adc"
    assert default_project({**environ, "GOOGLE_CLOUD_PROJECT": "from-adc", "PUBSUB_PROJECT_ID": "p"}) == "p"
    assert default_project({"CLOUDSDK_CONFIG": str(tmp_path / "none")}) == "local-project"


def test_the_toolbox_lists_what_gcloud_s_project_holds(
    pubsub_server, hedgepub_cli, monkeypatch, tmp_path
) -> None:
    gcloud = tmp_path / "gcloud"
    _write_gcloud_config(gcloud, "shop")
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(gcloud))
    assert hedgepub_cli("topics", "create", "projects/shop/topics/orders").exit_code == 0
    assert hedgepub_cli("topics", "list").stdout.split() == ["projects/shop/topics/orders"]


@pytest.mark.parametrize("source", ["stdin", "file"])
def test_publish_reads_200_kb_of_binary_data_from_stdin_or_a_file(pubsub_server, source, tmp_path) -> None:
    from hedgepub.admin import AdminClient

    with AdminClient(pubsub_server.address) as admin:
        admin.create_topic(TOPIC)
    data = os.urandom(200 * 1024)  # past what one command-line argument may hold on Linux (128 KiB)
    path = tmp_path / "message.bin"
    path.write_bytes(data)
    args = (
        ["publish", "orders", "-"] if source == "stdin" else ["publish", "orders", "--data-file", str(path)]
    )
    completed = subprocess.run(
        [*CLI, *args],
        input=data if source == "stdin" else b"",
        capture_output=True,
        timeout=60,
        env={**os.environ, "PUBSUB_EMULATOR_HOST": pubsub_server.address},
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    [stored] = pubsub_server.messages(TOPIC)
    assert stored.data == data
    assert stored.message_id == completed.stdout.decode().strip()


def test_publish_without_data_or_with_both_is_a_usage_error(pubsub_server, hedgepub_cli, tmp_path) -> None:
    (tmp_path / "m").write_text("x")
    assert hedgepub_cli("publish", "orders").exit_code == 2
    assert hedgepub_cli("publish", "orders", "text", "--data-file", str(tmp_path / "m")).exit_code == 2
    missing = hedgepub_cli("publish", "orders", "--data-file", str(tmp_path / "absent"))
    assert missing.exit_code == 2
    assert "cannot read" in missing.output
