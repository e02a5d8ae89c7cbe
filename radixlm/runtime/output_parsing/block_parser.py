"""Tool-call parsing for formats whose calls come in blocks that open with a marker: one
scanner serves streaming and whole outputs alike, so the two agree by construction.

A format says where a block may start (``find_block``: the marker's positions, and how long
a tail of the text could still grow into a marker; ``MarkerBlockParser`` gives it for a
format whose blocks all open with one fixed marker) and what a block at a start holds
(``match_block``): its calls and where it ends, ``INVALID`` (the marker is not followed by a
call after all), or ``INCOMPLETE`` (more text could still go either way). The scanner keeps
the text it has not decided; content goes out as soon as no marker can begin in it, a block
as soon as it is complete. An invalid block's marker is content, and the scan goes on after
it; at the end of the output every undecided byte is content.

A format keeps ``match_block`` monotone: a definite answer (calls or ``INVALID``) for a text
is the same for every text it is a prefix of. Given that, any split of an output into pieces
gives the same content and calls as the whole (tests/runtime/output_parsing check it).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

from radixlm.runtime.output_parsing.tool_call_types import (
    ParsedToolCalls,
    StreamPiece,
    ToolCall,
    ToolCallParser,
    ToolCallStream,
)


class Undecided(Enum):
    INCOMPLETE = "incomplete"
    INVALID = "invalid"


INCOMPLETE = Undecided.INCOMPLETE
INVALID = Undecided.INVALID


@dataclass(frozen=True)
class Block:
    """The calls of one block and the index just past it."""

    calls: list[ToolCall]
    end: int


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class BlockToolCallParser(ToolCallParser):
    """A parser over a block format (subclasses give ``find_block`` and ``match_block``)."""

    @abstractmethod
    def find_block(self, text: str, start: int) -> tuple[int | None, int]:
        """The first index at or after ``start`` where a block's marker begins (None if
        none), and how many characters at the end of ``text`` could still grow into a
        marker (0 if none; used only when no marker was found)."""

    @abstractmethod
    def match_block(self, text: str, start: int) -> Block | Undecided:
        """What the block whose marker begins at ``start`` holds (see module docstring)."""

    def parse(self, text: str) -> ParsedToolCalls:
        stream = self.stream()
        pieces = stream.feed(text) + stream.finish()
        content = "".join(piece for piece in pieces if isinstance(piece, str))
        return ParsedToolCalls(content, [p for p in pieces if isinstance(p, ToolCall)])

    def stream(self) -> ToolCallStream:
        return BlockStream(self)


class MarkerBlockParser(BlockToolCallParser):
    """A block format whose every block opens with one fixed ``marker`` (subclasses give
    ``marker`` and ``match_block``)."""

    marker: ClassVar[str]

    def find_block(self, text: str, start: int) -> tuple[int | None, int]:
        found = text.find(self.marker, start)
        if found >= 0:
            return found, 0
        return None, partial_suffix(text, self.marker)


class BlockStream(ToolCallStream):
    """The scanner of ``BlockToolCallParser`` (see module docstring)."""

    def __init__(self, parser: BlockToolCallParser):
        self._parser = parser
        self._text = ""  # the undecided text: what has not been given back yet

    def feed(self, text: str) -> list[StreamPiece]:
        self._text += text
        return self._scan(final=False)

    def finish(self) -> list[StreamPiece]:
        return self._scan(final=True)

    def _scan(self, final: bool) -> list[StreamPiece]:
        pieces: list[StreamPiece] = []
        text, pos = self._text, 0
        while pos < len(text):
            start, partial = self._parser.find_block(text, pos)
            if start is None:
                cut = len(text) if final else len(text) - partial
                if cut > pos:
                    pieces.append(text[pos:cut])
                pos = max(pos, cut)
                break
            if start > pos:
                pieces.append(text[pos:start])
            block = self._parser.match_block(text, start)
            if block is INCOMPLETE and not final:
                pos = start
                break
            if isinstance(block, Block):
                pieces.extend(block.calls)
                pos = block.end
                continue
            # Invalid (or incomplete at the end): the marker's first character is content,
            # and the scan goes on after it.
            pieces.append(text[start])
            pos = start + 1
        self._text = text[pos:]
        return _merged(pieces)


def _merged(pieces: list[StreamPiece]) -> list[StreamPiece]:
    """Adjacent content pieces joined into one."""
    merged: list[StreamPiece] = []
    for piece in pieces:
        if isinstance(piece, str) and merged and isinstance(merged[-1], str):
            merged[-1] += piece
        elif piece != "":
            merged.append(piece)
    return merged
