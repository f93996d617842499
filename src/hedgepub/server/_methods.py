"""How a fault rule or a count names an RPC: by its short name (``"Publish"``), its full gRPC path
(``"/google.pubsub.v1.Publisher/Publish"``) or, for a fault rule, ``"*"``: every method without a rule of
its own.

The table of the RPCs itself is :mod:`hedgepub._rpcs` (in the base package, so that ``hedgepub proxy``
needs no server extra); its names are re-exported here for the server's modules.
"""

from __future__ import annotations

from hedgepub._rpcs import METHODS, RPCS, SHORT_NAMES, STREAMING, Rpc

__all__ = ["METHODS", "RPCS", "SHORT_NAMES", "STREAMING", "WILDCARD", "Rpc", "resolve_method", "short_name"]

#: The method name of a rule that applies to every method that has no rule of its own.
WILDCARD = "*"


def resolve_method(name: str) -> str:
    """Return the full gRPC path of a method given by short name or full path (``"*"`` stays ``"*"``).

    Raises ``ValueError`` listing the valid names when ``name`` is none of them.
    """
    if not isinstance(name, str):
        raise TypeError(f"method must be a str; got {type(name).__name__} {name!r}")
    stripped = name.strip()
    if stripped == WILDCARD:
        return WILDCARD
    if stripped in METHODS:
        return METHODS[stripped]
    if stripped in SHORT_NAMES:
        return stripped
    raise ValueError(
        f"unknown RPC method {name!r}; valid methods are {WILDCARD!r} (all), "
        + ", ".join(METHODS)
        + " (or their full paths, such as '/google.pubsub.v1.Publisher/Publish')"
    )


def short_name(path: str) -> str:
    """The short name of the method at full gRPC ``path`` (``path`` itself when it is none of ours)."""
    return SHORT_NAMES.get(path, path)
