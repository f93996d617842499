"""Every extra in pyproject.toml is in the docs' extras table, with every package it brings; and the docs
extra alone brings what the API reference imports (``pip install -e '.[docs]'`` builds the site)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _table() -> dict[str, str]:
    rows = {}
    for line in (ROOT / "docs" / "install-and-errors.md").read_text().splitlines():
        match = re.match(r"\| `(\w+)` \| (.*)\|$", line)
        if match:
            rows[match.group(1)] = match.group(2).lower()
    return rows


def _name(requirement: str) -> str:
    return re.split(r"[<>=\[ ;]", requirement, maxsplit=1)[0].lower()


def test_every_extra_and_every_package_it_brings_is_in_the_table() -> None:
    table = _table()
    for extra, requirements in _extras().items():
        assert extra in table, f"the extras table leaves out {extra!r}"
        for requirement in requirements:
            name = _name(requirement)
            if name == "hedgepub":  # another extra: named as such
                for other in re.search(r"\[(.*)\]", requirement).group(1).split(","):  # type: ignore[union-attr]
                    assert f"`{other}`" in table[extra] or extra == "test", (extra, other)
                continue
            if extra == "test" and name.startswith(("pytest-", "types-", "grpc-stubs", "opentelemetry-sdk")):
                continue  # named as a group: "pytest and its plugins", "mypy and stubs"
            assert name.split("-")[0] in table[extra] or name in table[extra], (
                f"the {extra!r} row leaves out {name}"
            )


def test_the_docs_extra_brings_what_the_reference_imports() -> None:
    docs = _extras()["docs"]
    pages = " ".join(p.read_text() for p in (ROOT / "docs" / "reference").glob("*.md"))
    if "::: hedgepub.server" in pages:
        assert any(_name(r) == "hedgepub" and "server" in r for r in docs), docs
    if "::: hedgepub.testing" in pages:  # the pytest plugin imports pytest
        assert any(_name(r) == "pytest" for r in docs), docs
