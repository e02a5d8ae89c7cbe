"""Where a JSON value ends in a text that may still grow: the check the JSON-based tool-call
formats build their monotone ``match_block`` on (``block_parser.py`` states why it must be).

``scan_json(text, pos)`` reads one value (an object or an array) starting at ``pos`` and says

- ``JsonSpan``: the value is complete; ``end`` is the index just past it, and ``members``
  the spans of its outermost members (an object's keys with their values' spans, an array's
  elements' spans), so a parser can keep a member's own text;
- ``INVALID``: no text that begins with ``text[pos:]`` starts with a JSON value;
- ``INCOMPLETE``: the text ran out before either was decided.

Monotone by construction: the scan reads left to right and never looks past the closing
bracket, so a definite answer for a text stands for every text it is a prefix of. It follows
RFC 8259 strictly (no ``NaN``, no trailing commas, no control characters in strings), which
``json.loads`` then accepts on every complete span.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from radixlm.runtime.output_parsing.block_parser import INCOMPLETE, INVALID, Undecided

WHITESPACE = " \t\n\r"
_PLAIN_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]*')
_HEX = frozenset("0123456789abcdefABCDEF")
_ESCAPES = frozenset('"\\/bfnrt')
_LITERALS = ("true", "false", "null")

# The number automaton: state -> (characters, next state); the accepting states end a number.
_DIGITS = "0123456789"
_NUMBER_MOVES: dict[str, list[tuple[str, str]]] = {
    "start": [("-", "minus"), ("0", "zero"), ("123456789", "int")],
    "minus": [("0", "zero"), ("123456789", "int")],
    "zero": [(".", "dot"), ("eE", "e")],
    "int": [(_DIGITS, "int"), (".", "dot"), ("eE", "e")],
    "dot": [(_DIGITS, "frac")],
    "frac": [(_DIGITS, "frac"), ("eE", "e")],
    "e": [("+-", "sign"), (_DIGITS, "exp")],
    "sign": [(_DIGITS, "exp")],
    "exp": [(_DIGITS, "exp")],
}
_NUMBER_ENDS = frozenset({"zero", "int", "frac", "exp"})


@dataclass(frozen=True)
class JsonSpan:
    """A complete value: ``end`` is just past it; ``members`` are its outermost members as
    ``(key, start, end)`` (``key`` is None for an array's elements)."""

    end: int
    members: list[tuple[str | None, int, int]]

    def member_text(self, text: str, key: str) -> str | None:
        """The text of the value under ``key`` (the last one, as ``json.loads`` keeps)."""
        found = [text[a:b] for name, a, b in self.members if name == key]
        return found[-1] if found else None


def skip_whitespace(text: str, pos: int) -> int:
    """The first index at or after ``pos`` that is not JSON whitespace."""
    while pos < len(text) and text[pos] in WHITESPACE:
        pos += 1
    return pos


def scan_json(text: str, pos: int) -> JsonSpan | Undecided:
    """Reads the object or array that begins at ``text[pos]`` (see module docstring)."""
    if pos >= len(text):
        return INCOMPLETE
    if text[pos] not in "{[":
        return INVALID
    closers: list[str] = []  # the brackets still open, innermost last
    members: list[tuple[str | None, int, int]] = []
    key: str | None = None
    value_start = 0
    expect = "value"  # value | key | key_or_close | colon | value_or_close | comma_or_close
    i = pos
    while True:
        i = skip_whitespace(text, i)
        if i >= len(text):
            return INCOMPLETE
        char = text[i]
        if expect in ("comma_or_close", "key_or_close", "value_or_close") and char in "}]":
            if char != closers[-1]:
                return INVALID
            closers.pop()
            i += 1
            if not closers:
                return JsonSpan(i, members)
            if len(closers) == 1:
                members.append((key, value_start, i))
            expect = "comma_or_close"
            continue
        if expect == "comma_or_close":
            if char != ",":
                return INVALID
            expect = "key" if closers[-1] == "}" else "value"
            i += 1
            continue
        if expect == "colon":
            if char != ":":
                return INVALID
            expect = "value"
            i += 1
            continue
        if expect in ("key", "key_or_close"):
            if char != '"':
                return INVALID
            end = _string_end(text, i)
            if isinstance(end, Undecided):
                return end
            if len(closers) == 1:
                key = json.loads(text[i:end])
            i, expect = end, "colon"
            continue
        # A value (after a colon, a comma in an array, an opening bracket, or at the start).
        if len(closers) == 1:
            value_start = i
            if closers[-1] == "]":
                key = None
        if char in "{[":
            closers.append("}" if char == "{" else "]")
            expect = "key_or_close" if char == "{" else "value_or_close"
            i += 1
            continue
        end = _scalar_end(text, i)
        if isinstance(end, Undecided):
            return end
        if len(closers) == 1:
            members.append((key, value_start, end))
        i, expect = end, "comma_or_close"


def _scalar_end(text: str, i: int) -> int | Undecided:
    """The end of the string, number or literal at ``i``."""
    char = text[i]
    if char == '"':
        return _string_end(text, i)
    if char == "-" or char in _DIGITS:
        return _number_end(text, i)
    for word in _LITERALS:
        if text.startswith(word, i):
            return i + len(word)
        if len(text) - i < len(word) and word.startswith(text[i:]):
            return INCOMPLETE
    return INVALID


def _string_end(text: str, i: int) -> int | Undecided:
    """The index just past the string whose opening quote is at ``i``."""
    i += 1
    while True:
        i = _PLAIN_STRING_RUN.match(text, i).end()
        if i >= len(text):
            return INCOMPLETE
        char = text[i]
        if char == '"':
            return i + 1
        if char != "\\":
            return INVALID  # a control character
        if i + 1 >= len(text):
            return INCOMPLETE
        escape = text[i + 1]
        if escape in _ESCAPES:
            i += 2
            continue
        if escape != "u":
            return INVALID
        digits = text[i + 2:i + 6]
        if not all(d in _HEX for d in digits):
            return INVALID
        if len(digits) < 4:
            return INCOMPLETE
        i += 6


def _number_end(text: str, i: int) -> int | Undecided:
    """The index just past the number at ``i``: a number ends at the first character that
    cannot continue it, so one that reaches the end of the text is undecided."""
    state = "start"
    while i < len(text):
        char = text[i]
        moves = [nxt for chars, nxt in _NUMBER_MOVES[state] if char in chars]
        if not moves:
            return i if state in _NUMBER_ENDS else INVALID
        state = moves[0]
        i += 1
    return INCOMPLETE
