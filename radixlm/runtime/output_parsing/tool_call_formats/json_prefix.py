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

A stream asks again about the same block each time its text grows. ``JsonScan`` is a scan
that stopped where its text ran out and goes on from there; ``JsonScans`` keeps a few such
scans and takes one up for a text that begins with all the text it read, so a block is read
once, not once per piece. The answer is the one a fresh scan gives, since a scan's state
depends only on the text it read.
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
    return JsonScan().advance(text, pos)


class JsonScan:
    """A scan that stopped where its text ran out, to go on when the text has grown.

    Its fields say where the scan stands, relative to the value's first character: ``read``
    is where the next token begins (a string cut short goes on from ``string_from``), and the
    rest is the state of the reading (brackets open, what comes next, outermost members). It
    depends only on the text it read, so it goes on for any text that begins with that."""

    __slots__ = ("read", "string_from", "closers", "members", "key", "value_start", "expect")

    def __init__(self) -> None:
        self.read = 0
        self.string_from: int | None = None
        self.closers: list[str] = []  # the brackets still open, innermost last
        self.members: list[tuple[str | None, int, int]] = []
        self.key: str | None = None
        self.value_start = 0
        # value | key | key_or_close | colon | value_or_close | comma_or_close
        self.expect = "value"

    def copy(self) -> JsonScan:
        other = JsonScan()
        for name in self.__slots__:
            setattr(other, name, getattr(self, name))
        other.closers, other.members = list(self.closers), list(self.members)
        return other

    def advance(self, text: str, base: int) -> JsonSpan | Undecided:
        """Reads on in ``text``, whose value begins at ``base``; INCOMPLETE leaves the scan
        ready to go on."""
        if base >= len(text):
            return INCOMPLETE
        if text[base] not in "{[":
            return INVALID
        closers, members, expect = self.closers, self.members, self.expect
        i = base + self.read
        while True:
            i = skip_whitespace(text, i)
            self.read, self.expect = i - base, expect
            if i >= len(text):
                return INCOMPLETE
            char = text[i]
            if expect in ("comma_or_close", "key_or_close", "value_or_close") and char in "}]":
                if char != closers[-1]:
                    return INVALID
                closers.pop()
                i += 1
                if not closers:
                    return JsonSpan(i, [(key, base + a, base + b) for key, a, b in members])
                if len(closers) == 1:
                    members.append((self.key, self.value_start, i - base))
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
                end = self._string_end(text, i, base)
                if isinstance(end, Undecided):
                    return end
                if len(closers) == 1:
                    self.key = json.loads(text[i:end])
                i, expect = end, "colon"
                continue
            # A value (after a colon, a comma in an array, an opening bracket, or at the start).
            if len(closers) == 1:
                self.value_start = i - base
                if closers[-1] == "]":
                    self.key = None
            if char in "{[":
                closers.append("}" if char == "{" else "]")
                expect = "key_or_close" if char == "{" else "value_or_close"
                i += 1
                continue
            end = self._string_end(text, i, base) if char == '"' else _scalar_end(text, i)
            if isinstance(end, Undecided):
                return end
            if len(closers) == 1:
                members.append((self.key, self.value_start, end - base))
            i, expect = end, "comma_or_close"

    def _string_end(self, text: str, i: int, base: int) -> int | Undecided:
        """The end of the string at ``i``, going on from where a cut-off read of it stopped."""
        resume = i + 1 if self.string_from is None else base + self.string_from
        end, stopped = _string_end(text, resume)
        self.string_from = stopped - base if end is INCOMPLETE else None
        return end


class JsonScans:
    """Scans that stopped where their text ran out, kept so that a stream's growing block is
    read once, not once per piece: a scan is taken up again for a text that begins, at the
    value, with all the text the scan read. A few are kept (the most recent first), so one
    parser may serve several streams; a scan is copied before it goes on."""

    def __init__(self, size: int = 16):
        self._size = size
        self._scans: list[tuple[str, JsonScan]] = []  # (the text read, the scan)

    def scan_object(self, text: str, pos: int) -> JsonSpan | Undecided:
        """As ``scan``, for an object only: INVALID where ``text[pos]`` opens an array."""
        if pos < len(text) and text[pos] != "{":
            return INVALID
        return self.scan(text, pos)

    def scan(self, text: str, pos: int) -> JsonSpan | Undecided:
        """As ``scan_json(text, pos)``."""
        for read, kept in self._scans:
            if text.startswith(read, pos):
                scan = kept.copy()
                break
        else:
            scan = JsonScan()
        answer = scan.advance(text, pos)
        if answer is INCOMPLETE:
            self._scans = [(text[pos:], scan)] + self._scans[:self._size - 1]
        return answer


def _scalar_end(text: str, i: int) -> int | Undecided:
    """The end of the number or literal at ``i``."""
    char = text[i]
    if char == "-" or char in _DIGITS:
        return _number_end(text, i)
    for word in _LITERALS:
        if text.startswith(word, i):
            return i + len(word)
        if len(text) - i < len(word) and word.startswith(text[i:]):
            return INCOMPLETE
    return INVALID


def _string_end(text: str, i: int) -> tuple[int | Undecided, int]:
    """The index just past the string whose characters go on from ``i`` (just after its
    opening quote, or any later place outside an escape), and where a read of it that ran
    out of text may go on from."""
    while True:
        i = _PLAIN_STRING_RUN.match(text, i).end()
        if i >= len(text):
            return INCOMPLETE, i
        char = text[i]
        if char == '"':
            return i + 1, i
        if char != "\\":
            return INVALID, i  # a control character
        if i + 1 >= len(text):
            return INCOMPLETE, i
        escape = text[i + 1]
        if escape in _ESCAPES:
            i += 2
            continue
        if escape != "u":
            return INVALID, i
        digits = text[i + 2:i + 6]
        if not all(d in _HEX for d in digits):
            return INVALID, i
        if len(digits) < 4:
            return INCOMPLETE, i
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
