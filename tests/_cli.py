"""Running the ``hedgepub`` command in a child process, and waiting for ``hedgepub serve`` to be ready."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

#: The ``hedgepub`` command as the installed script runs it, without depending on the script being on PATH.
CLI: list[str] = [sys.executable, "-c", "from hedgepub.cli import main; main()"]

#: What ``hedgepub serve`` prints first on stdout once its port is open; its address follows.
READY_PREFIX = "export PUBSUB_EMULATOR_HOST="


def first_line(process: subprocess.Popen[bytes], timeout: float) -> str:
    """The first line ``process`` prints on stdout, stripped; ``""`` when none came within ``timeout`` s."""
    line: list[bytes] = []
    stdout = process.stdout
    assert stdout is not None, "start the process with stdout=subprocess.PIPE"
    # Read on a thread: a readline on the pipe itself would wait past any timeout.
    reader = threading.Thread(target=lambda: line.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return line[0].decode().strip() if line else ""


def served_address(process: subprocess.Popen[bytes], timeout: float, log_path: Path | None = None) -> str:
    """The address a ``hedgepub serve`` process announces on its first line.

    When that line is not the ready line within ``timeout`` seconds, the process is killed and the test
    fails, showing what it printed and its log (stderr), when it writes one to ``log_path``.
    """
    text = first_line(process, timeout)
    if not text.startswith(READY_PREFIX):
        process.kill()
        process.wait(10)
        log = "" if log_path is None else "\n" + log_path.read_text(errors="replace")
        pytest.fail(f"hedgepub serve did not get ready within {timeout} s: {text!r}{log}")
    return text[len(READY_PREFIX) :]


def terminate(process: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """Stop ``process`` cleanly (SIGTERM), and with SIGKILL when it has not ended after ``timeout`` s."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout)
