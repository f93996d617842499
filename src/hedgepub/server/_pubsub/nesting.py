"""Bounds on how deeply nested parsed input may be, checked before a recursive parser sees it.

Recursive parsers (the ``json`` module, protobuf's JSON mapping, fastavro's C reader) use the thread's
stack for each level of nesting: deep enough input raises ``RecursionError`` in the best case and crashes
the process (a segfault in C code) in the worst. Every parser of client input is given input checked
here first, by loops that use no stack, so that input nested deeper than the service takes is refused as
INVALID_ARGUMENT and never reaches the parser.
"""

from __future__ import annotations

import json
from typing import Any

from hedgepub.server._pubsub.limits import ServiceError, invalid

#: Deepest nesting of JSON arrays and objects taken anywhere (a request body, a schema definition, a
#: message in JSON encoding); protobuf's own JSON parser stops at 100 levels too.
MAX_JSON_DEPTH = 100


def value_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """How deeply a parsed JSON value's lists and dicts nest (0 for a scalar), counted up to ``limit + 1``;
    a loop over the containers, no recursion."""
    deepest = 0
    pending: list[tuple[Any, int]] = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        depth += 1
        if depth > deepest:
            deepest = depth
            if deepest > limit:
                return deepest
        pending.extend((child, depth) for child in children if isinstance(child, (dict, list)))
    return deepest


def load_json(text: bytes | str, what: str, limit: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads(text)``, refusing (INVALID_ARGUMENT, naming ``what``) a value nested deeper than
    ``limit``. Raises ``ValueError`` for text that is not JSON, as ``json.loads`` does.

    The ``json`` module's C decoder counts its own nesting and raises ``RecursionError`` (not a crash) at
    the interpreter's recursion limit; deeper than ``limit`` but within that, the loaded value is measured.
    """
    try:
        value = json.loads(text)
    except RecursionError:
        raise too_deep(what, limit) from None
    if value_depth(value, limit) > limit:
        raise too_deep(what, limit)
    return value


def too_deep(what: str, limit: int) -> ServiceError:
    """The INVALID_ARGUMENT of input nested deeper than ``limit`` levels."""
    return invalid(f"{what} is nested too deeply: at most {limit} levels are accepted.")
