"""Helpers for the CLI tests: run ``hedgepub`` in-process with click's runner."""

from __future__ import annotations

import socket
from collections.abc import Callable

import pytest
from click.testing import CliRunner, Result

from hedgepub.cli import main

Invoke = Callable[..., Result]


@pytest.fixture(autouse=True)
def _no_gcloud_project(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The default project may come from gcloud's configuration: none here, whatever the machine's."""
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path_factory.mktemp("gcloud")))
    monkeypatch.delenv("CLOUDSDK_CORE_PROJECT", raising=False)
    monkeypatch.delenv("CLOUDSDK_ACTIVE_CONFIG_NAME", raising=False)


@pytest.fixture
def hedgepub_cli() -> Invoke:
    """Run ``hedgepub ARGS...`` in this process and return click's result (exceptions are kept)."""
    runner = CliRunner()

    def invoke(*args: str) -> Result:
        return runner.invoke(main, list(args), catch_exceptions=False)

    return invoke


@pytest.fixture
def closed_port() -> int:
    """A port of 127.0.0.1 on which nothing listens (just freed by the OS)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
