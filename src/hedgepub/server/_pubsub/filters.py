"""Subscription filters: the Pub/Sub filter language, parsed once into a predicate on attributes.

The language, as the real service documents it (filters see a message's attributes, never its data):

- ``attributes:KEY``                       the message has attribute KEY;
- ``attributes.KEY = "value"``             it has KEY with exactly that value;
- ``attributes.KEY != "value"``            the negation of ``=`` (so a message without KEY matches);
- ``hasPrefix(attributes.KEY, "prefix")``  it has KEY and its value starts with the prefix;
- ``NOT x`` or ``-x``, ``x AND y AND ...``, ``x OR y OR ...``, parentheses. AND and OR cannot be mixed
  without parentheses (``a AND b OR c`` is refused, ``a AND (b OR c)`` is not); the operators are upper
  case.

A KEY made of other characters than letters, digits, ``-`` and ``_`` is written as a string literal
(``attributes."iana.org/language" = "en"``). String literals are in double (or single) quotes and take the
escapes ``\\\\``, ``\\"``, ``\\'``, ``\\n`` and the other C escapes, ``\\xHH``, ``\\uHHHH``, ``\\UHHHHHHHH``
and octal ``\\OOO``. A filter is at most 256 bytes.

:func:`compile_filter` turns the text into a plain function once, when a subscription is created; a
filter that does not parse is INVALID_ARGUMENT with a message saying where.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping

import lark
from lark import Lark, Token, Transformer, v_args

from hedgepub.server._pubsub.limits import ServiceError, invalid

#: Longest filter the real service takes, in bytes (UTF-8).
MAX_FILTER_BYTES = 256

#: A compiled filter: does a message with these attributes match?
Predicate = Callable[[Mapping[str, str]], bool]

_GRAMMAR = r"""
?start: expression
?expression: any_of | all_of | term
any_of: term (OR term)+
all_of: term (AND term)+
?term: negation | atom
negation: (NOT | MINUS) term
?atom: "(" expression ")" | has | equals | not_equals | has_prefix
has: ATTRIBUTES ":" key
equals: ATTRIBUTES "." key "=" literal
not_equals: ATTRIBUTES "." key "!=" literal
has_prefix: HAS_PREFIX "(" ATTRIBUTES "." key "," literal ")"
key: NAME | literal
literal: STRING
NAME: /[A-Za-z0-9_-]+/
STRING: /"(\\.|[^"\\])*"/ | /'(\\.|[^'\\])*'/
AND: "AND"
OR: "OR"
NOT: "NOT"
MINUS: "-"
ATTRIBUTES: "attributes"
HAS_PREFIX: "hasPrefix"
%ignore /[ \t\r\n]+/
"""

_SIMPLE_ESCAPES = {
    "a": "\a",
    "b": "\b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
    "v": "\v",
    "\\": "\\",
    "'": "'",
    '"': '"',
    "?": "?",
    "`": "`",
}
_HEX_ESCAPE_DIGITS = {"x": 2, "u": 4, "U": 8}
_ESCAPE = re.compile(r"\\(x[0-9A-Fa-f]{2}|u[0-9A-Fa-f]{4}|U[0-9A-Fa-f]{8}|[0-7]{3}|.)", re.DOTALL)

_TOKEN_WORDS = {
    "AND": "AND",
    "OR": "OR",
    "NOT": "NOT",
    "MINUS": "'-'",
    "ATTRIBUTES": "'attributes'",
    "HAS_PREFIX": "'hasPrefix'",
    "NAME": "an attribute key",
    "STRING": "a string literal",
    "LPAR": "'('",
    "RPAR": "')'",
    "COLON": "':'",
    "DOT": "'.'",
    "EQUAL": "'='",
    "__ANON_0": "'!='",
    "COMMA": "','",
    "$END": "the end of the filter",
}


class _FilterError(Exception):
    """A literal with a bad escape, found while building the predicate (the parse itself succeeded)."""

    def __init__(self, column: int, reason: str) -> None:
        super().__init__(reason)
        self.column = column
        self.reason = reason


def _unquote(token: Token) -> str:
    """The value of a string literal token, escapes decoded."""
    body = token.value[1:-1]

    def decode(match: re.Match[str]) -> str:
        escape = match.group(1)
        if escape[0] in "xuU" and len(escape) > 1:
            code = int(escape[1:], 16)
        elif escape[0] in "01234567" and len(escape) == 3:
            code = int(escape, 8)
        elif escape in _SIMPLE_ESCAPES:
            return _SIMPLE_ESCAPES[escape]
        else:
            column = (token.column or 1) + 1 + match.start()
            if escape in _HEX_ESCAPE_DIGITS:  # \x, \u or \U without all its hex digits
                digits = _HEX_ESCAPE_DIGITS[escape]
                raise _FilterError(column, f"escape sequence '\\{escape}' needs {digits} hex digits")
            raise _FilterError(column, f"unknown escape sequence '\\{escape}' in a string literal")
        if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
            column = (token.column or 1) + 1 + match.start()
            raise _FilterError(column, f"escape sequence '\\{escape}' is not a valid character")
        return chr(code)

    return _ESCAPE.sub(decode, body)


@v_args(inline=True)
class _ToPredicate(Transformer[Token, Predicate]):
    """Parse tree -> nested closures over the attributes mapping."""

    def literal(self, token: Token) -> str:
        return _unquote(token)

    def key(self, value: Token | str) -> str:
        return value if isinstance(value, str) and not isinstance(value, Token) else str(value)

    def has(self, _attributes: Token, key: str) -> Predicate:
        return lambda attributes: key in attributes

    def equals(self, _attributes: Token, key: str, value: str) -> Predicate:
        return lambda attributes: attributes.get(key) == value

    def not_equals(self, _attributes: Token, key: str, value: str) -> Predicate:
        return lambda attributes: attributes.get(key) != value

    def has_prefix(self, _function: Token, _attributes: Token, key: str, prefix: str) -> Predicate:
        def starts_with(attributes: Mapping[str, str]) -> bool:
            value = attributes.get(key)
            return value is not None and value.startswith(prefix)

        return starts_with

    def negation(self, _operator: Token, operand: Predicate) -> Predicate:
        return lambda attributes: not operand(attributes)

    @v_args(inline=False)
    def all_of(self, children: list[Predicate | Token]) -> Predicate:
        operands = tuple(child for child in children if not isinstance(child, Token))
        return lambda attributes: all(operand(attributes) for operand in operands)

    @v_args(inline=False)
    def any_of(self, children: list[Predicate | Token]) -> Predicate:
        operands = tuple(child for child in children if not isinstance(child, Token))
        return lambda attributes: any(operand(attributes) for operand in operands)


@functools.cache
def _parser() -> Lark:
    # LALR with the contextual lexer: "NOT", "attributes" and the like are keywords only where an
    # operator or a term may start, so they remain usable as attribute keys after "attributes.".
    return Lark(_GRAMMAR, parser="lalr", lexer="contextual", maybe_placeholders=False)


def _match_all(attributes: Mapping[str, str]) -> bool:
    return True


@functools.lru_cache(maxsize=1024)
def compile_filter(text: str) -> Predicate:
    """The predicate for a subscription's ``filter`` (every message matches the empty filter).

    Cached by text: a subscription's filter is parsed once, when it is created (or reloaded).
    Raises :class:`ServiceError` (INVALID_ARGUMENT) for a filter over 256 bytes or one that does not
    parse, saying where.
    """
    if not text:
        return _match_all
    size = len(text.encode("utf-8"))
    if size > MAX_FILTER_BYTES:
        raise invalid(
            f"Invalid filter given: the filter is {size} bytes long; the maximum is {MAX_FILTER_BYTES} bytes."
        )
    try:
        tree = _parser().parse(text)
        return _ToPredicate().transform(tree)
    except lark.exceptions.VisitError as error:
        original = error.orig_exc
        if isinstance(original, _FilterError):
            raise _syntax_error(text, original.column, original.reason) from None
        raise
    except lark.exceptions.UnexpectedInput as error:
        raise _describe(text, error) from None


def _syntax_error(text: str, column: int, reason: str) -> ServiceError:
    return invalid(f"Invalid filter given (filter={text}): at position {column}, {reason}.")


def _describe(text: str, error: lark.exceptions.UnexpectedInput) -> ServiceError:
    """Say where and why a filter failed to parse, in words a user can act on."""
    column = getattr(error, "column", None)
    if not isinstance(column, int) or column < 1:
        column = len(text) + 1
    expected = sorted(getattr(error, "expected", None) or getattr(error, "allowed", None) or ())
    if isinstance(error, lark.exceptions.UnexpectedToken):
        token = error.token
        if token.type == "$END":
            return _syntax_error(text, len(text) + 1, f"the filter ends early; expected {_words(expected)}")
        found = f"unexpected {token.value!r}"
        if token.type in {"AND", "OR"} and token.type not in expected:
            return _syntax_error(
                text,
                column,
                f"{found}: AND and OR cannot be combined without parentheses, as in a AND (b OR c)",
            )
        if token.value in {"and", "or", "not"}:
            return _syntax_error(text, column, f"{found}: the operators AND, OR and NOT are upper case")
        return _syntax_error(text, column, f"{found}; expected {_words(expected)}")
    if isinstance(error, lark.exceptions.UnexpectedCharacters):
        position = error.pos_in_stream
        character = text[position] if position is not None and position < len(text) else ""
        if character in "\"'":
            return _syntax_error(text, column, "a string literal is not closed")
        return _syntax_error(text, column, f"unexpected character {character!r}; expected {_words(expected)}")
    return _syntax_error(text, column, "the filter ends early")


def _words(expected: list[str]) -> str:
    names = sorted({_TOKEN_WORDS.get(name, name) for name in expected})
    if not names:
        return "nothing more"
    if len(names) == 1:
        return names[0]
    return ", ".join(names[:-1]) + " or " + names[-1]
