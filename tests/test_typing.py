"""Users' type checkers read hedgepub's annotations (the wheel ships ``py.typed``): hold them to it.

CI runs mypy over ``src/`` (``[tool.mypy]`` in pyproject.toml); these tests check the other side, a
user's program: the documented examples (every runnable ``python`` block of the README and the docs, as
``tests/test_docs.py`` finds them) and ``tests/typed_user_program.py`` (the public names with the types a
user must see, in strict mode) type-check against the hedgepub being tested. They also require every
``# type: ignore`` in ``src/`` to name its error code and say why.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import hedgepub

from .test_docs import PYTHON, ROOT

USER_PROGRAM = Path(__file__).with_name("typed_user_program.py")

# Errors inside hedgepub are CI's mypy run's to report; here only the users' side counts: hedgepub's
# annotations as a program calls them. So the examples' own code is not held to annotations of its own
# (an empty list needs none), and the official client (google.cloud.pubsub) ships no py.typed.
_CONFIG = """\
[mypy]
follow_imports = silent
check_untyped_defs = True
warn_unused_ignores = True
disable_error_code = var-annotated
cache_dir = {cache}

# strict mode's flags (a module section cannot say strict = True)
[mypy-typed_user_program]
disallow_any_generics = True
disallow_subclassing_any = True
disallow_untyped_calls = True
disallow_untyped_defs = True
disallow_incomplete_defs = True
disallow_untyped_decorators = True
warn_return_any = True
no_implicit_reexport = True
strict_equality = True
extra_checks = True

[mypy-google.cloud.*]
ignore_missing_imports = True
"""


def test_the_user_program_and_the_documented_examples_type_check(tmp_path: Path) -> None:
    package = Path(hedgepub.__file__).parent
    assert (package / "py.typed").is_file(), "without py.typed, users' type checkers ignore the annotations"
    files = [tmp_path / USER_PROGRAM.name]
    files[0].write_text(USER_PROGRAM.read_text(encoding="utf-8"), encoding="utf-8")
    names = {}
    for block in PYTHON:
        stem = re.sub(r"\W", "_", block.page.relative_to(ROOT).with_suffix("").as_posix())
        path = tmp_path / f"example_{stem}_{block.line}.py"
        path.write_text(block.code, encoding="utf-8")
        names[path.name] = block.where
        files.append(path)
    config = tmp_path / "mypy.ini"
    config.write_text(_CONFIG.format(cache=tmp_path / "cache"), encoding="utf-8")
    # A fresh process in the test's directory: mypy finds hedgepub where this interpreter imports it from.
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(config), *(path.name for path in files)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = result.stdout + result.stderr
    for name, where in names.items():  # name the page and line of an example, not the temporary file
        report = report.replace(name, where)
    assert result.returncode == 0, report
    assert "Success" in result.stdout, report


def test_the_user_program_uses_only_public_names() -> None:
    text = USER_PROGRAM.read_text(encoding="utf-8")
    imported = re.findall(r"^\s*(?:from|import) (hedgepub[\w.]*)", text, flags=re.M)
    assert imported, "the program imports nothing from hedgepub"
    private = [module for module in imported if any(part.startswith("_") for part in module.split("."))]
    assert private == []


_IGNORE = re.compile(r"#\s*type:\s*ignore(?P<codes>\[[^\]]*\])?(?P<rest>.*)$")


def test_every_type_ignore_names_its_code_and_a_reason() -> None:
    # The reason: a comment after the ignore on its line, or a comment line just above it.
    bad = []
    for path in sorted((ROOT / "src").rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines, start=1):
            match = _IGNORE.search(line)
            if match is None:
                continue
            above = lines[number - 2].strip() if number > 1 else ""
            reason = match.group("rest").strip().startswith("#") or above.startswith("#")
            if not match.group("codes") or not reason:
                bad.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert bad == []
