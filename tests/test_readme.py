"""The README's examples run as written, against the local server.

Every ```python block of README.md runs, unless its info string says ``fragment`` (```python fragment),
which marks a piece of code that cannot run on its own. A block that defines ``test_...`` functions is a
pytest file: it is saved and run by pytest in a fresh process, with hedgepub's plugin, as a user would run
it. Any other block runs in a fresh namespace, with ``PUBSUB_EMULATOR_HOST`` pointing at a local server on
which the examples' topic ``projects/my-project/topics/my-topic`` exists; blocks that start their own
server (most do) simply ignore it.

The IAM example's files (```json tokens.json, ```json policy.json) and its shell session run together:
``hedgepub serve`` with those two files, then each command of the session, with the exit code it promises.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hedgepub.bench import AdminClient
from hedgepub.server import LocalServer

README = Path(__file__).resolve().parent.parent / "README.md"
EXAMPLE_TOPIC = "projects/my-project/topics/my-topic"
_PYTHON = {"python", "py", "python3"}


def _fenced_blocks() -> list[tuple[int, list[str], str]]:
    """(line of the first code line, words of the info string, code) of every fenced block."""
    text = README.read_text(encoding="utf-8")
    blocks = []
    for match in re.finditer(r"^```(\S[^\n]*)\n(.*?)^```", text, flags=re.S | re.M):
        line = text.count("\n", 0, match.start()) + 2
        blocks.append((line, match.group(1).split(), match.group(2)))
    return blocks


BLOCKS = _fenced_blocks()
PYTHON_BLOCKS = [(line, code) for line, info, code in BLOCKS if info[0] in _PYTHON and "fragment" not in info]


def test_the_readme_has_python_examples() -> None:
    assert len(PYTHON_BLOCKS) >= 5


def test_every_python_block_is_found() -> None:
    # a block the pattern above missed would silently go untested
    text = README.read_text(encoding="utf-8")
    opened = len(re.findall(r"^```(?:python3?|py)\b", text, flags=re.M))
    assert opened == sum(1 for _, info, _ in BLOCKS if info[0] in _PYTHON)


@pytest.fixture
def example_server(monkeypatch: pytest.MonkeyPatch):
    with LocalServer(in_memory=True) as server:
        with AdminClient(server.address) as admin:
            admin.create_topic(EXAMPLE_TOPIC)
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", server.address)
        yield server


def _environment(**extra: str) -> dict[str, str]:
    """This process's environment with ``src`` first on the path, so children run this checkout."""
    environment = dict(os.environ)
    source = str(README.parent / "src")
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [source, environment.get("PYTHONPATH")]))
    environment.update(extra)
    return environment


@pytest.mark.parametrize(
    ("line", "code"), PYTHON_BLOCKS, ids=[f"README.md:{line}" for line, _ in PYTHON_BLOCKS]
)
def test_readme_example_runs(
    line: int, code: str, example_server: LocalServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    if re.search(r"^def test_", code, flags=re.M):
        test_file = tmp_path / "test_readme_example.py"
        test_file.write_text(code, encoding="utf-8")
        completed = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)],
            cwd=tmp_path,
            env=_environment(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert completed.returncode == 0, f"README.md:{line} fails under pytest:\n{completed.stdout}"
        return
    # Examples may set PUBSUB_EMULATOR_HOST themselves; monkeypatch restores it afterwards.
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", example_server.address)
    namespace: dict[str, object] = {"__name__": "readme_example"}
    exec(compile(code, f"README.md:{line}", "exec"), namespace)


def _iam_example() -> tuple[dict[str, str], list[str]]:
    """The IAM example's files (name -> text) and its shell session, one command a line."""
    files = {info[1]: code for _, info, code in BLOCKS if info[0] == "json" and len(info) > 1}
    session = next(
        code.splitlines()
        for _, info, code in BLOCKS
        if info[0] == "bash" and "--iam-tokens tokens.json" in code
    )
    return files, session


def test_the_iam_example_files_and_session_work_together(tmp_path: Path) -> None:
    files, session = _iam_example()
    assert {"tokens.json", "policy.json"} <= set(files)
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    serve_line, *commands = session
    serve = serve_line.split("#")[0].strip().rstrip("&").split()
    assert serve[:2] == ["hedgepub", "serve"]
    # The README's server listens on 8085 with SQLite in the working directory; this one takes any port.
    server = subprocess.Popen(
        [sys.executable, "-m", "hedgepub", *serve[1:], "--port", "0", "--in-memory"],
        cwd=tmp_path,
        env=_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        export = server.stdout.readline()
        if not export:
            pytest.fail(f"hedgepub serve did not start: {server.stderr.read()}")
        assert export.startswith("export PUBSUB_EMULATOR_HOST="), export
        address = export.strip().split("=", 1)[1]
        # `hedgepub` in the session is this checkout's command
        prelude = f'hedgepub() {{ "{sys.executable}" -m hedgepub "$@"; }}\n'
        for command in commands:
            if command.startswith("export PUBSUB_EMULATOR_HOST="):
                continue
            expected = 1 if "exit 1" in command else 0
            completed = subprocess.run(
                ["bash", "-c", prelude + command],
                cwd=tmp_path,
                env=_environment(PUBSUB_EMULATOR_HOST=address),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert completed.returncode == expected, f"{command!r}: {completed.stderr}"
            if expected:
                assert "PERMISSION_DENIED" in completed.stderr or "not authorized" in completed.stderr
    finally:
        server.terminate()
        server.wait(timeout=30)
