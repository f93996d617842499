"""The code blocks of the README and of the docs site (docs/*.md) run as written, against the local server.

Every fenced block names its language, and the language says what happens to it:

- ```` ```python ```` runs. A block that defines ``test_...`` functions is a pytest file: it is saved and
  run by pytest in a fresh process, with hedgepub's plugin, as a user would run it. Any other block runs
  in a fresh namespace, with ``PUBSUB_EMULATOR_HOST`` pointing at a local server on which the examples'
  topic ``projects/my-project/topics/my-topic`` exists; blocks that start their own server ignore it.
  ```` ```python { .fragment } ```` marks a piece of code that cannot run on its own.
- ```` ```bash { .session } ```` is a shell session run against ``hedgepub serve`` (the session's own
  ``hedgepub serve`` line, if it starts with one, on a free port and in memory), each command with the
  exit code it promises (``exit N`` in its comment, else 0); ``127.0.0.1:8085`` stands for the server's
  address. A comment line holding JSON right after a command is that command's output. The page's blocks
  with a ``title="FILE"`` are written to the session's working directory first.
  ```` ```bash { .no-run } ```` is a command that cannot run here (it needs credentials, gcloud,
  certificates, minutes of time or the test suite itself); say so explicitly, nothing is skipped silently.
- ```` ```json ```` must parse as JSON; ```` ```text ```` is output or syntax, not code.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from hedgepub.admin import AdminClient
from hedgepub.server import LocalServer

from ._cli import served_address, terminate

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
EXAMPLE_TOPIC = "projects/my-project/topics/my-topic"
LANGUAGES = {"python", "bash", "json", "text"}
_FENCE = re.compile(r"^```(\S[^\n]*)\n(.*?)^```[ \t]*$", flags=re.S | re.M)


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: Path
    line: int
    language: str
    classes: frozenset[str]
    title: str | None
    code: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    blocks = []
    for match in _FENCE.finditer(text):
        info = match.group(1)
        language = re.match(r"[\w+-]*", info).group(0)  # type: ignore[union-attr]
        attributes = re.search(r"\{(.*)\}", info)
        classes = frozenset(re.findall(r"\.([\w-]+)", attributes.group(1))) if attributes else frozenset()
        title = re.search(r'title="([^"]+)"', info)
        line = text.count("\n", 0, match.start()) + 2
        blocks.append(Block(page, line, language, classes, title and title.group(1), match.group(2)))
    return blocks


BLOCKS = [block for page in PAGES for block in _blocks(page)]
PYTHON = [block for block in BLOCKS if block.language == "python" and "fragment" not in block.classes]
SESSIONS = [block for block in BLOCKS if block.language == "bash" and "session" in block.classes]


def test_the_docs_have_examples() -> None:
    assert len(PYTHON) >= 15
    assert len(SESSIONS) >= 1


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(ROOT)) for page in PAGES])
def test_every_block_is_found_and_says_what_it_is(page: Path) -> None:
    # A fence the pattern above missed (indented, unclosed) would silently go untested.
    text = page.read_text(encoding="utf-8")
    blocks = _blocks(page)
    fences = len(re.findall(r"^[ \t]*```(?!`)", text, flags=re.M))  # ```` opens inline code, not a block
    assert fences == 2 * len(blocks), f"{page}: a fence is not found"
    for block in blocks:
        assert block.language in LANGUAGES, f"{block.where}: say which language ({sorted(LANGUAGES)})"
        if block.language == "bash":
            assert block.classes & {"session", "no-run"}, (
                f"{block.where}: mark it {{ .session }} or {{ .no-run }}"
            )
        if block.language == "json":
            json.loads(block.code)


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
    source = str(ROOT / "src")
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [source, environment.get("PYTHONPATH")]))
    environment.update(extra)
    return environment


@pytest.mark.parametrize("block", PYTHON, ids=[block.where for block in PYTHON])
def test_python_example_runs(
    block: Block, example_server: LocalServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    if re.search(r"^def test_", block.code, flags=re.M):
        test_file = tmp_path / "test_docs_example.py"
        test_file.write_text(block.code, encoding="utf-8")
        completed = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)],
            cwd=tmp_path,
            env=_environment(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert completed.returncode == 0, f"{block.where} fails under pytest:\n{completed.stdout}"
        return
    # Examples may set PUBSUB_EMULATOR_HOST themselves; monkeypatch restores it afterwards.
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", example_server.address)
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "docs_example"}
    exec(compile(block.code, block.where, "exec"), namespace)


def _commands(code: str) -> list[tuple[str, str]]:
    """(command, comment) of each line of a session; a comment line after a command is (``""``, comment)."""
    joined = re.sub(r"\\\n\s*", " ", code)
    commands = []
    for line in joined.splitlines():
        command, _, comment = line.partition("  #") if not line.startswith("#") else ("", "", line[1:])
        if command.strip() or comment.strip():
            commands.append((command.strip(), comment.strip()))
    return commands


@pytest.mark.parametrize("block", SESSIONS, ids=[block.where for block in SESSIONS])
def test_shell_session_runs(block: Block, tmp_path: Path) -> None:
    for other in _blocks(block.page):
        if other.title:
            (tmp_path / other.title).write_text(other.code, encoding="utf-8")
    commands = _commands(block.code)
    serve = ["serve"]
    if commands[0][0].startswith("hedgepub serve"):
        serve = shlex.split(commands.pop(0)[0].rstrip("&"))[1:]
    process = subprocess.Popen(
        [sys.executable, "-m", "hedgepub", *serve, "--port", "0", "--in-memory"],
        cwd=tmp_path,
        env=_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        address = served_address(process, timeout=60)
        # `hedgepub` in the session is this checkout's command
        prelude = f'hedgepub() {{ "{sys.executable}" -m hedgepub "$@"; }}\n'
        previous: subprocess.CompletedProcess[str] | None = None
        for command, comment in commands:
            if not command:
                if previous is not None and comment.startswith("{"):
                    assert json.loads(previous.stdout) == json.loads(comment), (
                        f"{block.where}: {previous.args}"
                    )
                continue
            if command.startswith("export PUBSUB_EMULATOR_HOST="):
                continue
            if command.split()[0] == "curl" and shutil.which("curl") is None:
                pytest.skip("curl is not installed")
            expected = re.search(r"\bexit (\d+)", comment)
            completed = subprocess.run(
                ["bash", "-c", prelude + command.replace("127.0.0.1:8085", address)],
                cwd=tmp_path,
                env=_environment(PUBSUB_EMULATOR_HOST=address),
                capture_output=True,
                text=True,
                timeout=60,
            )
            code = int(expected.group(1)) if expected else 0
            assert completed.returncode == code, f"{block.where}: {command!r}: {completed.stderr}"
            status = re.search(r"\b[A-Z]+_[A-Z_]+\b", comment)
            if code and status:
                assert status.group(0) in completed.stderr, f"{block.where}: {command!r}: {completed.stderr}"
            if comment.startswith("{"):
                assert json.loads(completed.stdout) == json.loads(comment), f"{block.where}: {command!r}"
            previous = completed
    finally:
        terminate(process)


def test_the_docs_site_builds_strict(tmp_path: Path) -> None:
    # .ci/run builds the site too; here a docstring or a link that breaks it shows in any full test run.
    pytest.importorskip("mkdocs")
    completed = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=_environment(NO_MKDOCS_2_WARNING="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-5000:]


_PATH = re.compile(
    r"(?<![\w/.-])((?:src/hedgepub/|tests/|benchmarks/|_publisher/|_hedging/|_transport/|server/|cli/|bench/"
    r"|testing/)[\w/]*\.py)\b"
)


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(ROOT)) for page in PAGES])
def test_the_files_a_page_names_exist(page: Path) -> None:
    # Modules move; a page naming one that is gone sends the next engineer nowhere.
    named = set(_PATH.findall(page.read_text(encoding="utf-8")))
    missing = [
        path for path in named if not (ROOT / path).exists() and not (ROOT / "src/hedgepub" / path).exists()
    ]
    assert not missing, f"{page.relative_to(ROOT)} names files that do not exist: {sorted(missing)}"


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(ROOT)) for page in PAGES])
def test_table_rows_are_whole(page: Path) -> None:
    # A row wrapped onto a second line ends the table there, and the rest shows as a loose paragraph.
    outside = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    broken = [
        line for line in outside.splitlines() if line.startswith("|") and not line.rstrip().endswith("|")
    ]
    assert not broken, f"{page.relative_to(ROOT)}: table rows cut short: {broken}"


def test_the_readme_stays_a_front_page() -> None:
    # The README says what hedgepub is and links into docs/; the details live on the pages.
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 300, f"README.md has {lines} lines: move the details to a page under docs/"
