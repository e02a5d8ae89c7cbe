"""Reading a block of marked-up tool calls left to right, so that a format's ``match_block``
is monotone (``block_parser.py``) by construction.

A ``BlockCursor`` reads literals, whitespace and delimited fields from a position of the
text. Each read either succeeds on the text it has, or stops the match with an answer that
no longer text can change: ``INCOMPLETE`` when the rest of the text is a prefix of what the
read expects (more text could still go either way), ``INVALID`` when no text that extends
this one could satisfy it. A format writes its ``match_block`` as a sequence of reads inside
``read_block``; since every definite answer depends only on text the cursor has read, the
answer for a text is the answer for every text it is a prefix of.

A field read with ``until`` ends at the first occurrence of its terminator; a forbidden
substring inside the field makes the block invalid, decided as soon as the substring lies
wholly before any place a terminator could still begin.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from radixlm.runtime.output_parsing.block_parser import (
    INCOMPLETE,
    INVALID,
    Block,
    Undecided,
    partial_suffix,
)


class StopReading(Exception):
    """Ends a block's match early with ``answer`` (INCOMPLETE or INVALID)."""

    def __init__(self, answer: Undecided):
        super().__init__(answer.value)
        self.answer = answer


def read_block(text: str, start: int,
               read: Callable[[BlockCursor], Block]) -> Block | Undecided:
    """``read`` run on a cursor at ``start``: the block it returns, or where it stopped."""
    try:
        return read(BlockCursor(text, start))
    except StopReading as stop:
        return stop.answer


def literal_end(text: str, pos: int, literal: str) -> int | Undecided:
    """The index past ``literal`` at ``pos``; INCOMPLETE where the text ends inside it,
    INVALID where it holds something else."""
    if text.startswith(literal, pos):
        return pos + len(literal)
    return INCOMPLETE if literal.startswith(text[pos:pos + len(literal)]) else INVALID


def skip_space(text: str, pos: int) -> int:
    """The first index at or after ``pos`` that is not whitespace (``str.isspace``)."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


class BlockCursor:
    """A position in ``text`` that moves only forward, by reads that succeed."""

    def __init__(self, text: str, pos: int):
        self.text = text
        self.pos = pos

    def literal(self, expected: str) -> None:
        """Reads ``expected`` exactly."""
        end = literal_end(self.text, self.pos, expected)
        if isinstance(end, Undecided):
            raise StopReading(end)
        self.pos = end

    def one_of(self, *choices: str) -> tuple[int, str]:
        """Reads whichever of ``choices`` (none a prefix of another) comes next: its index and
        text."""
        rest = self.text[self.pos:self.pos + max(map(len, choices))]
        for index, choice in enumerate(choices):
            if rest.startswith(choice):
                self.pos += len(choice)
                return index, choice
        if any(choice.startswith(rest) for choice in choices):
            raise StopReading(INCOMPLETE)
        raise StopReading(INVALID)

    def skip_space(self) -> None:
        """Reads any whitespace."""
        self.pos = skip_space(self.text, self.pos)

    def until(self, terminator: str, forbidden: tuple[str, ...] = ()) -> str:
        """Reads a field up to the first ``terminator`` and the terminator; returns the
        field. A field holding any of ``forbidden`` is invalid."""
        end = self.text.find(terminator, self.pos)
        if end < 0:
            # A terminator may still begin in the tail that is a prefix of it; a forbidden
            # substring wholly before that tail is in the field whatever comes next.
            settled = self.text[self.pos:len(self.text) - partial_suffix(self.text, terminator)]
            if any(word in settled for word in forbidden):
                raise StopReading(INVALID)
            raise StopReading(INCOMPLETE)
        field = self.text[self.pos:end]
        if any(word in field for word in forbidden):
            raise StopReading(INVALID)
        self.pos = end + len(terminator)
        return field

    def fail_unless(self, condition: bool) -> None:
        """Stops the match as invalid unless ``condition`` (a check of text already read)."""
        if not condition:
            raise StopReading(INVALID)


def json_object_text(arguments: dict[str, Any]) -> str | None:
    """``arguments`` as a JSON object's text, or None where JSON cannot hold it (a float
    that is not finite, a string with a lone surrogate, nesting past the recursion limit)."""
    try:
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")
    except (ValueError, TypeError, RecursionError, UnicodeEncodeError):
        return None
    return text
