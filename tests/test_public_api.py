"""The public face of hedgepub: one curated list, complete and sorted."""

from __future__ import annotations

import hedgepub


def test_all_is_sorted_and_unique() -> None:
    assert list(hedgepub.__all__) == sorted(set(hedgepub.__all__))


def test_every_listed_name_exists() -> None:
    missing = [name for name in hedgepub.__all__ if not hasattr(hedgepub, name)]
    assert missing == []


def test_every_public_attribute_is_listed() -> None:
    public = {
        name
        for name, value in vars(hedgepub).items()
        if not name.startswith("_") and getattr(value, "__module__", "").startswith("hedgepub")
    }
    assert public - set(hedgepub.__all__) == set()


def test_every_public_name_has_a_docstring() -> None:
    undocumented = [name for name in hedgepub.__all__ if not (getattr(hedgepub, name).__doc__ or "").strip()]
    assert undocumented == []
