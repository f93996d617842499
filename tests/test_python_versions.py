"""The supported Python versions are declared once: requires-python, the classifiers, and the versions the
type checker and the linter assume agree, and CI (``.ci/other-pythons``) tests each declared version."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "Programming Language :: Python :: 3."


def _project() -> dict:  # type: ignore[type-arg]
    with (ROOT / "pyproject.toml").open("rb") as stream:
        return tomllib.load(stream)


def _declared() -> list[int]:
    """The minor versions of Python 3 the classifiers name, in order."""
    classifiers = _project()["project"]["classifiers"]
    return sorted(
        int(c[len(PREFIX) :]) for c in classifiers if c.startswith(PREFIX) and c[len(PREFIX) :].isdigit()
    )


def test_requires_python_and_the_classifiers_name_the_same_versions() -> None:
    declared = _declared()
    assert declared == list(range(declared[0], declared[-1] + 1)), "no gap between the versions"
    assert _project()["project"]["requires-python"] == f">=3.{declared[0]}"
    assert _project()["tool"]["mypy"]["python_version"] == f"3.{declared[0]}"
    assert _project()["tool"]["ruff"]["target-version"] == f"py3{declared[0]}"


def test_the_version_running_the_tests_is_declared() -> None:
    assert sys.version_info[:2][0] == 3 and sys.version_info[1] in _declared()


def test_ci_tests_every_other_declared_version_on_its_own_interpreter() -> None:
    # .ci/other-pythons reads the versions from the classifiers; .ci/run calls it after the whole suite.
    listed = subprocess.run(
        ["bash", str(ROOT / ".ci" / "other-pythons"), "--list"], capture_output=True, text=True, check=True
    ).stdout.split("\n")
    running = f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert [line.split()[0] for line in listed if line] == [
        f"3.{minor}" for minor in _declared() if f"3.{minor}" != running
    ]
    for line in filter(None, listed):
        version, interpreter = line.split()
        reported = subprocess.run(
            [interpreter, "-c", "import sys; print(*sys.version_info[:2], sep='.')"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert reported == version
    assert "bash .ci/other-pythons" in (ROOT / ".ci" / "run").read_text()
