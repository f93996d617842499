"""The filter language: parsing, matching, and errors that say where (no server needed)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hedgepub._status import StatusCode
from hedgepub.server._pubsub.filters import MAX_FILTER_BYTES, compile_filter
from hedgepub.server._pubsub.limits import ServiceError

CASES = [
    # (filter, attributes, matches)
    ("attributes:domain", {"domain": "com"}, True),
    ("attributes:domain", {"other": "com"}, False),
    ("NOT attributes:domain", {}, True),
    ("-attributes:domain", {"domain": ""}, False),
    ('attributes.domain = "com"', {"domain": "com"}, True),
    ('attributes.domain = "com"', {"domain": "Com"}, False),
    ('attributes.domain = "com"', {}, False),
    ('attributes.domain != "com"', {}, True),
    ('attributes.domain != "com"', {"domain": "org"}, True),
    ('attributes.domain != "com"', {"domain": "com"}, False),
    ('hasPrefix(attributes.domain, "co")', {"domain": "com"}, True),
    ('hasPrefix(attributes.domain, "co")', {"domain": "org"}, False),
    ('hasPrefix(attributes.domain, "co")', {}, False),
    ('NOT hasPrefix(attributes.domain, "co")', {}, True),
    ('hasPrefix(attributes.domain, "")', {"domain": ""}, True),
    ('attributes:domain AND attributes.domain = "com" AND attributes:x', {"domain": "com", "x": ""}, True),
    ('attributes:domain AND attributes.domain = "com" AND attributes:x', {"domain": "com"}, False),
    ('attributes.domain = "com" OR attributes.domain = "org" OR attributes:x', {"domain": "org"}, True),
    ('attributes.domain = "com" OR attributes.domain = "org"', {"domain": "net"}, False),
    ('attributes:a AND (attributes.b = "1" OR attributes.b = "2")', {"a": "", "b": "2"}, True),
    ("(attributes:a AND attributes:b) OR attributes:c", {"c": "1"}, True),
    ("NOT (attributes:a OR attributes:b)", {"c": "1"}, True),
    ("- (attributes:a OR attributes:b)", {"a": "1"}, False),
    ("NOT NOT attributes:a", {"a": "1"}, True),
    # Keys: letters, digits, - and _ bare; anything else as a string literal.
    ('attributes.ce-type = "x"', {"ce-type": "x"}, True),
    ('attributes.9_lives = "x"', {"9_lives": "x"}, True),
    ('attributes."iana.org/language_tag" = "en"', {"iana.org/language_tag": "en"}, True),
    ("attributes:'has space'", {"has space": "1"}, True),
    # Words that are operators elsewhere are plain keys after "attributes.".
    ('attributes.NOT = "1" AND attributes:AND', {"NOT": "1", "AND": ""}, True),
    ('attributes.attributes = "hasPrefix"', {"attributes": "hasPrefix"}, True),
    # Escapes in literals.
    (r'attributes.k = "a\"b\\c"', {"k": 'a"b\\c'}, True),
    (r'attributes.k = "\x41\u00e9\U0001F600\101\n\t"', {"k": "Aé\U0001f600A\n\t"}, True),
    (r"attributes.k = 'it\'s'", {"k": "it's"}, True),
    ('attributes.k = "é"', {"k": "é"}, True),
    # Whitespace is free between tokens.
    ('  attributes.k="v"AND(attributes:j)  ', {"k": "v", "j": ""}, True),
]


@pytest.mark.parametrize(("text", "attributes", "matches"), CASES)
def test_filters_match_as_documented(text: str, attributes: dict[str, str], matches: bool) -> None:
    assert compile_filter(text)(attributes) is matches


def test_the_empty_filter_matches_everything() -> None:
    assert compile_filter("")({}) is True
    assert compile_filter("")({"a": "b"}) is True


BAD = [
    # (filter, words the message must contain)
    ("attributes:a AND attributes:b OR attributes:c", ["position 31", "AND and OR cannot be combined"]),
    ("attributes:a OR attributes:b AND attributes:c", ["position 30", "AND and OR cannot be combined"]),
    ("NOT attributes:a AND attributes:b OR attributes:c", ["AND and OR cannot be combined"]),
    ("attributes:a and attributes:b", ["position 14", "upper case"]),
    ("attributes:a or attributes:b", ["upper case"]),
    ("not attributes:a", ["position 1"]),
    ("attributes.a = x", ["position 16", "string literal"]),
    ('attributes.a = "x', ["position 16", "not closed"]),
    ("(attributes:a", ["ends early", "')'"]),
    ("attributes:a)", ["position 13", "unexpected ')'"]),
    ("attributes", ["ends early"]),
    ("attributes.a", ["ends early"]),
    ("attributes.a =", ["ends early"]),
    ("foo", ["position 1", "unexpected 'foo'"]),
    ('data = "x"', ["position 1"]),
    ('attributes.a == "x"', ["position"]),
    ("hasPrefix(attributes.a)", ["position 23"]),
    ('hasPrefix(attributes:a, "x")', ["position 21"]),
    ('attributes.a = "\\q"', ["position 17", "escape"]),
    ('attributes.a = "\\uD800"', ["not a valid character"]),
    ('attributes.a = "\\x0"', ["position 17", "needs 2 hex digits"]),
    ('attributes.a = "\\x"', ["position 17", "needs 2 hex digits"]),
    ('attributes.a = "\\u12"', ["position 17", "needs 4 hex digits"]),
    ('attributes.a = "\\U0001F60"', ["position 17", "needs 8 hex digits"]),
    ("attributes:a AND", ["ends early"]),
    ("()", ["position 2"]),
    ('attributes.a.b = "x"', ["position 13"]),
]


@pytest.mark.parametrize(("text", "words"), BAD)
def test_bad_filters_say_where(text: str, words: list[str]) -> None:
    with pytest.raises(ServiceError) as caught:
        compile_filter(text)
    assert caught.value.code == StatusCode.INVALID_ARGUMENT
    assert f"(filter={text})" in caught.value.message
    for word in words:
        assert word in caught.value.message, caught.value.message


def test_the_length_limit_is_256_bytes() -> None:
    key = "k" * (MAX_FILTER_BYTES - len("attributes:"))
    assert compile_filter(f"attributes:{key}")({key: ""}) is True
    with pytest.raises(ServiceError, match="257 bytes long; the maximum is 256"):
        compile_filter(f"attributes:{key}k")
    # Bytes, not characters: 2-byte characters reach the limit in half as many characters.
    with pytest.raises(ServiceError, match="bytes long"):
        compile_filter('attributes.k = "' + "é" * 125 + '"')


# ---------------------------------------------------------------- generated filters
# An expression tree, rendered to text and evaluated here by a plain interpreter independent of the
# parser: the compiled predicate must agree with it on every attribute set.

KEYS = ["a", "b", "ce-type", "x.y", 'quo"te']
VALUES = ["", "v", "va", "w", 'q"\\']


@dataclass(frozen=True)
class Leaf:
    kind: str  # has, eq, ne, prefix
    key: str
    value: str = ""


@dataclass(frozen=True)
class Node:
    kind: str  # not, and, or
    children: tuple[object, ...]


def _literal(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _key(key: str) -> str:
    return key if key.replace("-", "").replace("_", "").isalnum() else _literal(key)


def render(tree: object, spaced: bool) -> str:
    if isinstance(tree, Leaf):
        key = _key(tree.key)
        if tree.kind == "has":
            return f"attributes:{key}"
        if tree.kind == "prefix":
            return f"hasPrefix(attributes.{key}, {_literal(tree.value)})"
        operator = "=" if tree.kind == "eq" else "!="
        gap = " " if spaced else ""
        return f"attributes.{key}{gap}{operator}{gap}{_literal(tree.value)}"
    assert isinstance(tree, Node)
    if tree.kind == "not":
        return ("NOT " if spaced else "-") + _wrapped(tree.children[0], spaced)
    joiner = " AND " if tree.kind == "and" else " OR "
    return joiner.join(_wrapped(child, spaced) for child in tree.children)


def _wrapped(tree: object, spaced: bool) -> str:
    text = render(tree, spaced)
    return f"({text})" if isinstance(tree, Node) and tree.kind != "not" else text


def evaluate(tree: object, attributes: dict[str, str]) -> bool:
    if isinstance(tree, Leaf):
        value = attributes.get(tree.key)
        if tree.kind == "has":
            return value is not None
        if tree.kind == "eq":
            return value == tree.value
        if tree.kind == "ne":
            return value != tree.value
        return value is not None and value.startswith(tree.value)
    assert isinstance(tree, Node)
    results = [evaluate(child, attributes) for child in tree.children]
    if tree.kind == "not":
        return not results[0]
    return all(results) if tree.kind == "and" else any(results)


leaves = st.builds(
    Leaf, st.sampled_from(["has", "eq", "ne", "prefix"]), st.sampled_from(KEYS), st.sampled_from(VALUES)
)
trees = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.builds(lambda child: Node("not", (child,)), children),
        st.builds(
            lambda kind, items: Node(kind, tuple(items)),
            st.sampled_from(["and", "or"]),
            st.lists(children, min_size=2, max_size=3),
        ),
    ),
    max_leaves=6,
)
attribute_sets = st.lists(
    st.dictionaries(st.sampled_from(KEYS), st.sampled_from(VALUES), max_size=4), min_size=1, max_size=6
)


@settings(max_examples=300, deadline=None)
@given(tree=trees, samples=attribute_sets, spaced=st.booleans())
def test_generated_filters_agree_with_a_plain_interpreter(
    tree: object, samples: list[dict[str, str]], spaced: bool
) -> None:
    text = render(tree, spaced)
    if len(text.encode()) > MAX_FILTER_BYTES:
        return
    predicate = compile_filter(text)
    for attributes in samples:
        assert predicate(attributes) is evaluate(tree, attributes), (text, attributes)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list('attributes.:=!"()-NOTANDORhasPrefix, k\\')), max_size=60))
def test_any_text_parses_or_is_invalid_argument(text: str) -> None:
    try:
        predicate = compile_filter(text)
    except ServiceError as error:
        assert error.code == StatusCode.INVALID_ARGUMENT
        assert "position" in error.message or "bytes long" in error.message
    else:
        assert predicate({"k": "v"}) in (True, False)


#: ``HEDGEPUB_TRUST_EXAMPLES`` multiplies the number of cases of the fuzz tests below (as in tests/trust).
SCALE = int(os.environ.get("HEDGEPUB_TRUST_EXAMPLES", "") or 1)
_LITERAL_PIECES = st.sampled_from(
    [
        "\\",
        "\\x",
        "\\u",
        "\\U",
        "\\0",
        "\\7",
        "0",
        "1",
        "9",
        "a",
        "F",
        "g",
        "D8",
        "00",
        '\\"',
        "'",
        "q",
        " ",
        "\u00e9",
    ]
)


@settings(max_examples=1000 * SCALE, deadline=None)
@given(st.lists(_LITERAL_PIECES, max_size=30).map("".join), st.sampled_from(['"', "'"]))
def test_any_string_literal_parses_or_is_invalid_argument(body: str, quote: str) -> None:
    """Escapes cut short (``\\x0``, ``\\u12``), out of range or unknown: INVALID_ARGUMENT, never a crash."""
    for text in (f"attributes.a = {quote}{body}{quote}", f"hasPrefix(attributes.{quote}{body}{quote}, 'x')"):
        try:
            predicate = compile_filter(text)
        except ServiceError as error:
            assert error.code == StatusCode.INVALID_ARGUMENT
        else:
            assert predicate({"a": "v"}) in (True, False)


@pytest.mark.parametrize("opening", ["(", "NOT ", "-", "NOT (", "-("])
def test_nesting_up_to_the_length_limit_compiles(opening: str) -> None:
    """The deepest nesting 256 bytes allow parses and evaluates without exhausting the stack."""
    closing = ")" * opening.count("(")
    depth = (MAX_FILTER_BYTES - len("attributes:a")) // (len(opening) + len(closing))
    text = opening * depth + "attributes:a" + closing * depth
    assert len(text.encode()) <= MAX_FILTER_BYTES
    assert compile_filter(text)({"a": "v"}) in (True, False)
