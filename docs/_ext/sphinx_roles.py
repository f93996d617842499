"""A griffe extension for the API reference: the docstrings' Sphinx roles as Markdown.

hedgepub's docstrings name other objects the Sphinx way (``:class:`~hedgepub.RpcError```,
``:meth:`LocalServer.start```). mkdocstrings renders Markdown, where a role would show as literal text, so
each role becomes inline code, linked when its target is on a reference page (a public name of
``hedgepub``, ``hedgepub.server`` or ``hedgepub.testing``, or a documented member of one). A role naming a
private module or function stays plain code: a link to it would have nowhere to go, and ``mkdocs build
--strict`` fails on links that go nowhere. A reST literal-block marker (a paragraph ending in ``::``) is
turned into a colon, since the indented block after it is already code in Markdown.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|mod|func|meth|attr|data|exc|obj):`(~?)([^`]+)`")
_LITERAL_MARKER = re.compile(r"(?<=\S)::$", flags=re.M)
_PUBLIC_MODULES = ("hedgepub", "hedgepub.server")
_TESTING_MODULES = ("hedgepub.testing.plugin", "hedgepub.testing.scripted", "hedgepub.testing.virtual_time")


def _public_names() -> dict[str, tuple[str, Any]]:
    """Short name -> (the identifier its reference page gives it, the object)."""
    names: dict[str, tuple[str, Any]] = {}
    for module_name in _PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            names.setdefault(name, (f"{module_name}.{name}", getattr(module, name)))
    for module_name in _TESTING_MODULES:
        module = importlib.import_module(module_name)
        names[module_name] = (module_name, module)
        for name, value in vars(module).items():
            if not name.startswith("_") and getattr(value, "__module__", None) == module_name:
                names.setdefault(name, (f"{module_name}.{name}", value))
    names["hedgepub.testing"] = ("hedgepub.testing", importlib.import_module("hedgepub.testing"))
    return names


class SphinxRoles(griffe.Extension):
    """Rewrites every docstring's Sphinx roles and literal-block markers (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._names = _public_names()

    def _identifier(self, target: str) -> str | None:
        """The reference identifier ``target`` resolves to, or None when it is not on a reference page."""
        if target in self._names:
            return self._names[target][0]
        parts = target.lstrip(".").split(".")
        # a full path (hedgepub.server.LocalServer, hedgepub.dedup.Deduplicator) names its last public part
        for index in range(len(parts)):
            head = parts[index]
            if head not in self._names:
                continue
            identifier, value = self._names[head]
            rest = parts[index + 1 :]
            if not rest:
                return identifier
            if len(rest) == 1 and inspect.isclass(value) and not rest[0].startswith("_"):
                member = vars(value).get(rest[0])
                if member is not None and (inspect.getdoc(member) or "").strip():
                    return f"{identifier}.{rest[0]}"
            return None
        return None

    def _rewrite(self, text: str) -> str:
        def replace(match: re.Match[str]) -> str:
            short, target = match.group(1), match.group(2).strip()
            shown = target.rsplit(".", 1)[-1] if short else target.lstrip(".")
            identifier = self._identifier(target)
            return f"[`{shown}`][{identifier}]" if identifier else f"`{shown}`"

        return _LITERAL_MARKER.sub(":", _ROLE.sub(replace, text))

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = self._rewrite(obj.docstring.value)
