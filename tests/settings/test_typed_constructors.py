"""The constructors that hedgepub/_settings.py declares for type checkers only (``if TYPE_CHECKING:``,
so that a duration may be given as a ``timedelta``) match the ones dataclass generates at run time:
the same parameters, in the same order, with the same defaults."""

from __future__ import annotations

import ast
import dataclasses
import inspect

import pytest

from hedgepub import _settings


def _declared() -> dict[str, ast.FunctionDef]:
    tree = ast.parse(inspect.getsource(_settings))
    found = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        for statement in node.body:
            if isinstance(statement, ast.If) and ast.unparse(statement.test) == "TYPE_CHECKING":
                for inner in statement.body:
                    if isinstance(inner, ast.FunctionDef) and inner.name == "__init__":
                        found[node.name] = inner
    return found


DECLARED = _declared()


def test_every_settings_class_with_a_duration_declares_one() -> None:
    assert set(DECLARED) == {"AdaptiveDelay", "HedgingSettings", "RetrySettings", "BatchSettings"}


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_the_declared_constructor_matches_the_fields(name: str) -> None:
    cls = getattr(_settings, name)
    declared = DECLARED[name]
    parameters = [argument.arg for argument in declared.args.args[1:]]
    assert parameters == [field.name for field in dataclasses.fields(cls)]
    assert not declared.args.kwonlyargs and declared.args.vararg is None and declared.args.kwarg is None
    defaults = [eval(ast.unparse(default), vars(_settings)) for default in declared.args.defaults]
    assert defaults == [
        field.default if field.default is not dataclasses.MISSING else field.default_factory()
        for field in dataclasses.fields(cls)
    ]
    # And the generated one takes the same: every parameter, by position too.
    assert list(inspect.signature(cls).parameters) == parameters
