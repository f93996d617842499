"""gRPC's C-core log lines stay off the terminal unless the user asks for them with GRPC_VERBOSITY."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from ._cli import CLI

# Binds a port that is taken: gRPC's core then logs "E... add_port.cc:...] Failed to add port ..." on its
# own, besides the RuntimeError Python gets. FIRST decides what is imported before grpc.
_SCRIPT = """
import os, sys
{first}
import grpc
from concurrent import futures
server = grpc.server(futures.ThreadPoolExecutor(1))
try:
    server.add_insecure_port("127.0.0.1:{port}")
except RuntimeError:
    pass
print(os.environ.get("GRPC_VERBOSITY", "unset"))
"""


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


def _run(args: list[str], **environment: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != "GRPC_VERBOSITY"}
    env.update(environment)
    return subprocess.run(args, capture_output=True, text=True, timeout=60, env=env, check=False)


def test_importing_hedgepub_first_keeps_grpc_core_lines_quiet(busy_port: int) -> None:
    completed = _run([sys.executable, "-c", _SCRIPT.format(first="import hedgepub", port=busy_port)])
    assert completed.returncode == 0, completed.stderr
    assert "add_port" not in completed.stderr
    assert completed.stderr == ""
    # the variable was only set around the import: the user's environment, and children's, is unchanged
    assert completed.stdout.strip() == "unset"


def test_without_hedgepub_grpc_prints_them(busy_port: int) -> None:
    # the control: what a user saw before, and what the test above would see without the fix
    completed = _run([sys.executable, "-c", _SCRIPT.format(first="", port=busy_port)])
    assert "add_port" in completed.stderr


def test_a_verbosity_the_user_set_is_kept(busy_port: int) -> None:
    script = _SCRIPT.format(first="import hedgepub", port=busy_port)
    completed = _run([sys.executable, "-c", script], GRPC_VERBOSITY="ERROR")
    assert "add_port" in completed.stderr
    assert completed.stdout.strip() == "ERROR"


def test_serve_on_a_taken_port_prints_one_clean_line(busy_port: int) -> None:
    completed = _run([*CLI, "serve", "--port", str(busy_port), "--in-memory"])
    assert completed.returncode == 1
    assert completed.stderr.splitlines() == [
        f"Error: cannot start the server on 127.0.0.1:{busy_port}: cannot listen on 127.0.0.1:{busy_port} "
        "(in use, or not an address of this machine)"
    ]


def test_the_command_with_vv_shows_them(busy_port: int) -> None:
    # the hedgepub command's argv as the package sees it when it is imported: `hedgepub -vv ...`
    first = "sys.argv[:] = ['/usr/local/bin/hedgepub', '-vv', 'serve']; import hedgepub"
    completed = _run([sys.executable, "-c", _SCRIPT.format(first=first, port=busy_port)])
    assert "add_port" in completed.stderr
    assert completed.stdout.strip() == "unset"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["/usr/bin/hedgepub", "-vv", "serve"], 2),
        (["-m", "-v", "--verbose", "-v", "bench"], 3),
        (["hedgepub", "serve", "-vv"], 2),  # after the sub-command too, as the command accepts it
        (["hedgepub", "-v", "serve", "--port", "0", "-v"], 2),
        (["hedgepub", "publish", "t", "--", "-vv"], 0),  # after --: data, not an option
        (["hedgepub", "-v", "serve"], 1),
        (["/usr/bin/python3", "-vv"], 0),  # another program
    ],
)
def test_the_command_line_verbosity_is_read_before_and_after_the_sub_command(
    argv: list[str], expected: int
) -> None:
    from hedgepub._transport.grpc_logging import command_line_verbosity

    assert command_line_verbosity(argv) == expected
