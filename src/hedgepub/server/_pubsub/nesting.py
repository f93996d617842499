"""Bounds on how deeply nested parsed input may be, checked before a recursive parser sees it.

Recursive parsers (the ``json`` module, protobuf's JSON mapping, fastavro's C reader) use the thread's
stack for each level of nesting: deep enough input raises ``RecursionError`` in the best case and crashes
the process (a segfault in C code) in the worst. Every parser of client input is given input checked
here first, by loops that use no stack, so that input nested deeper than the service takes is refused as
INVALID_ARGUMENT and never reaches the parser.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
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


#: Deepest nesting of records, arrays and maps in an Avro message (binary encoding) taken; only a schema
#: that refers to itself lets a message nest deeper than its schema does.
MAX_AVRO_DEPTH = 100

_AVRO_PRIMITIVES = frozenset({"null", "boolean", "int", "long", "float", "double", "bytes", "string"})
_FIXED_WIDTH = {"null": 0, "boolean": 1, "float": 4, "double": 8}


def avro_is_recursive(schema: Any) -> bool:
    """Whether a parsed Avro schema (its JSON value) refers to a named type from inside that type.

    ``schema`` is assumed already checked by :func:`load_json` (no deeper than :data:`MAX_JSON_DEPTH`), so
    the walk here may recurse.
    """
    found = False

    def walk(node: Any, namespace: str, open_names: frozenset[str]) -> None:
        nonlocal found
        if found:
            return
        if isinstance(node, str):
            if _full_name(node, namespace) in open_names or node in open_names:
                found = True
            return
        if isinstance(node, list):
            for branch in node:
                walk(branch, namespace, open_names)
            return
        if not isinstance(node, dict):
            return
        kind = node.get("type")
        if kind in ("record", "error", "enum", "fixed") and isinstance(node.get("name"), str):
            inner = _namespace_of(node, namespace)
            name = _full_name(node["name"], inner)
            inner = name.rpartition(".")[0]
            if kind in ("record", "error"):
                names = open_names | {name}
                for item in node.get("fields") or ():
                    if isinstance(item, dict):
                        walk(item.get("type"), inner, names)
            return
        if kind == "array":
            walk(node.get("items"), namespace, open_names)
        elif kind == "map":
            walk(node.get("values"), namespace, open_names)
        else:
            walk(kind, namespace, open_names)

    walk(schema, "", frozenset())
    return found


def _full_name(name: str, namespace: str) -> str:
    return name if "." in name or not namespace else f"{namespace}.{name}"


def _namespace_of(node: dict[str, Any], enclosing: str) -> str:
    """A named type's own namespace, or the enclosing one where it names none (or not as text)."""
    own = node.get("namespace")
    return own if isinstance(own, str) else enclosing


def _avro_types(schema: Any) -> Iterator[tuple[Any, str]]:
    """Every type of a parsed Avro schema in a type's place (unions as lists, and records, enums, fixed,
    arrays, maps and annotated types as dicts), depth first in order, each with the namespace around it.

    ``schema`` is assumed already checked by :func:`load_json`, so the walk may recurse.
    """

    def walk(node: Any, namespace: str) -> Iterator[tuple[Any, str]]:
        if isinstance(node, list):
            yield node, namespace
            for branch in node:
                yield from walk(branch, namespace)
            return
        if not isinstance(node, dict):
            return
        yield node, namespace
        kind = node.get("type")
        if kind in ("record", "error", "enum", "fixed") and isinstance(node.get("name"), str):
            inner = _namespace_of(node, namespace)
            inner = _full_name(node["name"], inner).rpartition(".")[0]
            for item in node.get("fields") or ():
                if isinstance(item, dict):
                    yield from walk(item.get("type"), inner)
        elif kind == "array":
            yield from walk(node.get("items"), namespace)
        elif kind == "map":
            yield from walk(node.get("values"), namespace)
        else:
            yield from walk(kind, namespace)

    return walk(schema, "")


def avro_has_choices(schema: Any) -> bool:
    """Whether a parsed Avro schema has a union or an enum: a value that is an index into a list, which
    the Avro reader would also take negative (see :func:`check_avro_depth`)."""
    return any(isinstance(node, list) or node.get("type") == "enum" for node, _ in _avro_types(schema))


def _avro_named_types(schema: Any) -> dict[str, Any]:
    """Every named type (record, enum, fixed) of a parsed schema by its full name (and its short name)."""
    names: dict[str, Any] = {}
    for node, namespace in _avro_types(schema):
        if isinstance(node, dict) and node.get("type") in ("record", "error", "enum", "fixed"):
            name = node.get("name")
            if isinstance(name, str):
                inner = _namespace_of(node, namespace)
                full = _full_name(name, inner)
                names[full] = node
                names.setdefault(full.rpartition(".")[2], node)
    return names


class _Truncated(Exception):
    """The data ends (or stops making sense) before the value does: the Avro reader says what is wrong."""


def check_avro_depth(schema: Any, data: bytes, limit: int = MAX_AVRO_DEPTH) -> None:
    """Refuse (INVALID_ARGUMENT) a binary Avro message that nests records, arrays and maps deeper than
    ``limit`` levels, or holds more items than its bytes could encode; read with a loop and a stack of
    its own, so that no depth of input can exhaust the thread's stack.

    It reads only as far as the data makes sense: what is wrong besides depth is left to the Avro reader
    (which, given the same bytes, cannot go deeper than this walk did), but for a union branch or an enum
    symbol out of range, refused here (INVALID_ARGUMENT), since the reader takes a negative one as valid.
    """
    named = _avro_named_types(schema)
    budget = max(100_000, 16 * len(data))  # items; an array of a billion nulls is a few bytes
    position = 0

    def varint() -> int:
        nonlocal position
        shift = result = 0
        while True:
            if position >= len(data) or shift > 63:
                raise _Truncated
            byte = data[position]
            position += 1
            result |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return (result >> 1) ^ -(result & 1)
            shift += 7

    def skip(size: int) -> None:
        nonlocal position
        if size < 0 or position + size > len(data):
            raise _Truncated
        position += size

    # Each entry: (schema node, namespace, depth) for a value to read, or ("block", node, namespace,
    # depth, items left in the block) for the rest of an array or map.
    stack: list[tuple[Any, ...]] = [("value", schema, "", 0)]
    try:
        while stack:
            budget -= 1
            if budget < 0:
                raise too_deep_or_large("The Avro message holds more items than its size allows")
            entry = stack.pop()
            if entry[0] == "block":
                _, node, namespace, depth, left = entry
                if left == 0:
                    count = varint()
                    if count == 0:
                        continue
                    if count < 0:
                        count = -count
                        varint()  # the block's size in bytes
                    left = count
                stack.append(("block", node, namespace, depth, left - 1))
                if node.get("type") == "map":
                    stack.append(("value", node.get("values"), namespace, depth))
                    skip(varint())  # the key
                else:
                    stack.append(("value", node.get("items"), namespace, depth))
                continue
            _, node, namespace, depth = entry
            if isinstance(node, str):
                if node in _FIXED_WIDTH:
                    skip(_FIXED_WIDTH[node])
                elif node in ("int", "long"):
                    varint()
                elif node in ("bytes", "string"):
                    skip(varint())
                else:
                    target = named.get(_full_name(node, namespace)) or named.get(node)
                    if target is None:
                        raise _Truncated
                    stack.append(("value", target, namespace, depth))
                continue
            if isinstance(node, list):
                index = varint()
                if not 0 <= index < len(node):
                    # Refused here: the Avro reader takes a negative index as counting from the end (a
                    # Python list's), so that b"\x01" (-1) reads as the union's last branch, over and over
                    # in C until its stack runs out.
                    raise invalid(f"The Avro message names branch {index} of a union of {len(node)}.")
                stack.append(("value", node[index], namespace, depth))
                continue
            if not isinstance(node, dict):
                raise _Truncated
            kind = node.get("type")
            if kind in ("record", "error"):
                if depth + 1 > limit:
                    raise too_deep("The Avro message", limit)
                inner = _namespace_of(node, namespace)
                inner = _full_name(str(node.get("name", "")), inner).rpartition(".")[0]
                fields = [item.get("type") for item in node.get("fields") or () if isinstance(item, dict)]
                stack.extend(("value", field, inner, depth + 1) for field in reversed(fields))
            elif kind in ("array", "map"):
                if depth + 1 > limit:
                    raise too_deep("The Avro message", limit)
                stack.append(("block", node, namespace, depth + 1, 0))
            elif kind == "enum":
                index = varint()
                symbols = node.get("symbols")
                if isinstance(symbols, list) and not 0 <= index < len(symbols):
                    raise invalid(f"The Avro message names symbol {index} of an enum of {len(symbols)}.")
            elif kind == "fixed":
                size = node.get("size")
                skip(size if isinstance(size, int) else -1)
            else:  # {"type": "string", "logicalType": ...} and the like
                stack.append(("value", kind, namespace, depth))
    except _Truncated:
        return


def too_deep_or_large(what: str) -> ServiceError:
    """The INVALID_ARGUMENT of a message that claims more items than it can hold."""
    return invalid(f"{what}.")
