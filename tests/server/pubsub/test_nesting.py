"""Depth checks that keep deeply nested input away from recursive parsers (json, fastavro's C reader):
measured without recursion, refused as INVALID_ARGUMENT, and never refusing what is within the bound."""

from __future__ import annotations

import io
import json
import os
from typing import Any

import fastavro
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hedgepub._status import StatusCode
from hedgepub.server._pubsub.limits import ServiceError
from hedgepub.server._pubsub.nesting import (
    MAX_AVRO_DEPTH,
    MAX_JSON_DEPTH,
    avro_is_recursive,
    check_avro_depth,
    load_json,
)

#: ``HEDGEPUB_TRUST_EXAMPLES`` multiplies the number of generated cases (as in tests/trust).
SCALE = int(os.environ.get("HEDGEPUB_TRUST_EXAMPLES", "") or 1)

LINKED = {"type": "record", "name": "N", "fields": [{"name": "next", "type": ["null", "N"]}]}
TREE = {
    "type": "record",
    "name": "Tree",
    "namespace": "example.tree",
    "fields": [
        {"name": "label", "type": "string"},
        {"name": "children", "type": {"type": "array", "items": "Tree"}},
        {"name": "named", "type": {"type": "map", "values": "example.tree.Tree"}},
        {"name": "size", "type": {"type": "fixed", "name": "Size", "size": 2}},
        {"name": "kind", "type": {"type": "enum", "name": "Kind", "symbols": ["A", "B"]}},
        {"name": "weight", "type": ["null", "double", "long"]},
    ],
}


def _refused(call: Any) -> ServiceError:
    with pytest.raises(ServiceError) as caught:
        call()
    assert caught.value.code == StatusCode.INVALID_ARGUMENT
    assert "nested too deeply" in caught.value.message or "more items" in caught.value.message
    return caught.value


def test_the_reported_linked_list_ten_thousand_deep_is_refused_before_fastavro() -> None:
    assert avro_is_recursive(LINKED)
    _refused(lambda: check_avro_depth(LINKED, b"\x02" * 10_000 + b"\x00"))
    _refused(lambda: check_avro_depth(LINKED, b"\x02" * 100_000))  # deep, and cut short too
    check_avro_depth(LINKED, b"\x02" * (MAX_AVRO_DEPTH - 1) + b"\x00")
    value = fastavro.schemaless_reader(
        io.BytesIO(b"\x02" * (MAX_AVRO_DEPTH - 1) + b"\x00"), fastavro.parse_schema(LINKED)
    )
    assert value is not None


def test_non_recursive_schemas_are_told_apart() -> None:
    assert avro_is_recursive(TREE)
    assert not avro_is_recursive({"type": "record", "name": "R", "fields": [{"name": "a", "type": "long"}]})
    assert not avro_is_recursive(
        {
            "type": "record",
            "name": "R",
            "fields": [
                {"name": "a", "type": {"type": "record", "name": "S", "fields": []}},
                {"name": "b", "type": "S"},  # a second use of a named type is no recursion
            ],
        }
    )


def test_a_billion_zero_width_items_are_refused() -> None:
    schema = {"type": "array", "items": "null"}
    # One block of 2^30 nulls: three bytes that would make a list of a billion items.
    _refused(lambda: check_avro_depth(schema, b"\x80\x80\x80\x80\x08\x00"))


def _trees(depth: int) -> st.SearchStrategy[dict[str, Any]]:
    leaf = st.fixed_dictionaries(
        {
            "label": st.sampled_from(["", "a", "é"]),
            "children": st.just([]),
            "named": st.just({}),
            "size": st.binary(min_size=2, max_size=2),
            "kind": st.sampled_from(["A", "B"]),
            "weight": st.one_of(st.none(), st.floats(allow_nan=False), st.integers(-(2**62), 2**62)),
        }
    )
    return st.recursive(
        leaf,
        lambda inner: st.builds(
            lambda base, children, named: {**base, "children": children, "named": named},
            leaf,
            st.lists(inner, max_size=3),
            st.dictionaries(st.sampled_from(["k", "l"]), inner, max_size=2),
        ),
        max_leaves=depth,
    )


def _depth(tree: dict[str, Any]) -> int:
    """Records count one level, and so do their array and map (empty or not)."""
    inner = [*tree["children"], *tree["named"].values()]
    return 2 + max(map(_depth, inner), default=0)


@settings(max_examples=150 * SCALE, deadline=None)
@given(tree=_trees(12), limit=st.integers(1, 10))
def test_the_depth_walk_agrees_with_fastavro(tree: dict[str, Any], limit: int) -> None:
    """Messages fastavro wrote: refused exactly when deeper than the limit, and never misread."""
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(TREE), tree)
    data = out.getvalue()
    if _depth(tree) > limit:
        _refused(lambda: check_avro_depth(TREE, data, limit))
    else:
        check_avro_depth(TREE, data, limit)


@settings(max_examples=1000 * SCALE, deadline=None)
@given(data=st.binary(max_size=200))
def test_any_bytes_are_walked_without_error_or_refused(data: bytes) -> None:
    for schema in (LINKED, TREE):
        try:
            check_avro_depth(schema, data, 5)
        except ServiceError as error:
            assert error.code == StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000,
        '{"a":' * 5_000 + "1" + "}" * 5_000,
        "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1),
    ],
    ids=["brackets", "objects", "one-over"],
)
def test_json_nested_too_deeply_is_refused(text: str) -> None:
    _refused(lambda: load_json(text, "The body"))


def test_json_within_the_bound_loads() -> None:
    text = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert load_json(text, "The body") == json.loads(text)
    assert load_json('{"a": "[[[[", "b": [1, {"c": null}]}', "x") == {"a": "[[[[", "b": [1, {"c": None}]}
