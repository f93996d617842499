"""The checkout itself: what git ignores, and that CI runs every check the README asks contributors to run."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _git_checkout() -> bool:
    return shutil.which("git") is not None and (ROOT / ".git").exists()


@pytest.mark.skipif(not _git_checkout(), reason="not a git checkout")
@pytest.mark.parametrize(
    "path",
    [".hedgepub-data/pubsub.sqlite3", ".hedgepub-data/pubsub.sqlite3-wal", ".hedgepub-data/lock"],
)
def test_what_hedgepub_serve_leaves_in_a_checkout_is_ignored(path: str) -> None:
    # `hedgepub serve` keeps its data in ./.hedgepub-data by default; none of it belongs in git.
    ignored = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT, check=False)
    assert ignored.returncode == 0, f"git does not ignore {path}"


def test_ci_runs_every_check_the_readme_asks_contributors_to_run() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    development = readme.split("## Development", 1)[1]
    block = re.search(r"```bash[^\n]*\n(.*?)```", development, flags=re.S)
    assert block is not None, "the README's Development section lost its commands"
    checks = [
        command.strip()
        for line in block.group(1).splitlines()
        for command in line.split("#", 1)[0].split("&&")
        if command.strip().startswith("ruff ")
    ]
    assert checks, "the README names no ruff check"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    ci_commands = {line.strip() for line in ci.splitlines()}
    for check in checks:
        assert check in ci_commands, f".ci/run does not run `{check}`, which the README asks for"
