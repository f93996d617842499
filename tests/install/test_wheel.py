"""The built wheel, installed in a fresh virtual environment (not the source tree), and used there.

`.ci/run` builds the wheel and sdist (`python -m build`), checks them (`twine check`) and runs this with
``HEDGEPUB_WHEEL`` naming the wheel. The environment gets the wheel with its base dependencies first: it
imports, reports its version, publishes to a server, and `hedgepub serve` says which extra it needs. Then
``hedgepub[server]`` from the same wheel: its own `hedgepub serve`, to which its `hedgepub publish`
publishes and from which its `hedgepub pull` reads the message back.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hedgepub.cli._exit import EXIT_MISSING_EXTRA

from .._cli import served_address, terminate

WHEEL_VARIABLE = "HEDGEPUB_WHEEL"
WHEEL = os.environ.get(WHEEL_VARIABLE)

pytestmark = pytest.mark.skipif(
    not WHEEL, reason=f"{WHEEL_VARIABLE} is not set (.ci/run builds the wheel and sets it to its path)"
)


def _environment() -> dict[str, str]:
    # Nothing of the source tree or of the test run's environment leaks into the fresh one.
    drop = {"PYTHONPATH", "PUBSUB_EMULATOR_HOST", "VIRTUAL_ENV", "PYTHONHOME"}
    return {key: value for key, value in os.environ.items() if key not in drop}


def _run(args: list[str], cwd: Path, **environment: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, cwd=cwd, env={**_environment(), **environment}, capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with the wheel and its base dependencies only."""
    root = tmp_path_factory.mktemp("wheel")
    created = _run([sys.executable, "-m", "venv", str(root / "venv")], root)
    assert created.returncode == 0, created.stderr
    installed = _run([str(root / "venv" / "bin" / "pip"), "install", "--quiet", str(WHEEL)], root)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return root / "venv"


def test_the_wheel_is_what_the_environment_imports_with_one_version(venv: Path) -> None:
    code = (
        "import hedgepub, importlib.metadata as m; "
        "print(hedgepub.__file__); print(hedgepub.__version__); print(m.version('hedgepub'))"
    )
    completed = _run([str(venv / "bin" / "python"), "-c", code], venv.parent)
    assert completed.returncode == 0, completed.stderr
    location, version, metadata_version = completed.stdout.split()
    assert Path(location).is_relative_to(venv)
    assert version == metadata_version
    assert Path(str(WHEEL)).name.startswith(f"hedgepub-{version}-")
    shown = _run([str(venv / "bin" / "hedgepub"), "--version"], venv.parent)
    assert shown.stdout.strip() == f"hedgepub {version}"


def test_the_base_install_brings_no_extra(venv: Path) -> None:
    extras = ("lark", "fastavro", "grpc_tools", "aiohttp", "rich", "matplotlib", "numpy")
    code = f"import importlib.util as u; print([m for m in {extras!r} if u.find_spec(m)])"
    completed = _run([str(venv / "bin" / "python"), "-c", code], venv.parent)
    assert completed.stdout.strip() == "[]", completed.stderr
    refused = _run([str(venv / "bin" / "hedgepub"), "serve", "--port", "0"], venv.parent)
    assert refused.returncode == EXIT_MISSING_EXTRA
    assert "pip install 'hedgepub[server]'" in refused.stderr


def test_the_base_install_publishes(venv: Path, pubsub_server) -> None:
    from hedgepub.admin import AdminClient

    topic = "projects/local-project/topics/wheel"
    with AdminClient(pubsub_server.address) as admin:
        admin.create_topic(topic)
    code = (
        "import hedgepub\n"
        "with hedgepub.PublisherClient() as client:\n"
        f"    print(client.publish({topic!r}, b'through the wheel').result(30))\n"
    )
    completed = _run(
        [str(venv / "bin" / "python"), "-c", code], venv.parent, PUBSUB_EMULATOR_HOST=pubsub_server.address
    )
    assert completed.returncode == 0, completed.stderr
    [stored] = pubsub_server.messages(topic)
    assert (stored.message_id, stored.data) == (completed.stdout.strip(), b"through the wheel")


def test_the_server_extra_serves_and_the_toolbox_publishes_to_it(venv: Path) -> None:
    installed = _run([str(venv / "bin" / "pip"), "install", "--quiet", f"{WHEEL}[server]"], venv.parent)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    hedgepub = str(venv / "bin" / "hedgepub")
    server = subprocess.Popen(
        [hedgepub, "serve", "--port", "0", "--in-memory"],
        cwd=venv.parent,
        env=_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        address = served_address(server, timeout=60)
        steps = [
            ["topics", "create", "orders"],
            ["subscriptions", "create", "audit", "--topic", "orders"],
            ["publish", "orders", "from the wheel"],
        ]
        for step in steps:
            done = _run([hedgepub, *step], venv.parent, PUBSUB_EMULATOR_HOST=address)
            assert done.returncode == 0, (step, done.stderr)
        pulled = _run([hedgepub, "pull", "audit", "--ack"], venv.parent, PUBSUB_EMULATOR_HOST=address)
        assert pulled.returncode == 0, pulled.stderr
        assert pulled.stdout.split("\t")[1].strip() == "from the wheel"
    finally:
        terminate(server)
