"""Incremental detokenization and stop-string detection for one request's output.

Decoding token by token breaks where one character spans several tokens (UTF-8 split
across byte-level BPE tokens) and where a tokenizer's spacing depends on the previous
token (SentencePiece's leading "▁"). So each step decodes a short window that begins a few
tokens back and emits only the text past what was already emitted, and holds text back
while it ends in an incomplete character (U+FFFD).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

CONTEXT_TOKENS = 5
"""Prompt tokens decoded in front of the output so the first output token is spaced right."""
REPLACEMENT_CHAR = "\ufffd"


@dataclass
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text without re-decoding all of it each step.

    Invariant: ``text`` is the decoding of every output token fed so far, except a trailing
    incomplete character, which appears once the tokens that complete it arrive (or at
    ``finish``).
    """

    tokenizer: PreTrainedTokenizerBase
    prompt_ids: list[int]
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    text: str = ""
    _ids: list[int] = field(default_factory=list)
    _prefix_offset: int = 0
    _read_offset: int = 0

    def __post_init__(self) -> None:
        self._ids = list(self.prompt_ids[-CONTEXT_TOKENS:])
        self._read_offset = len(self._ids)

    def feed(self, token_ids: list[int]) -> str:
        """Adds output tokens; returns the newly completed text (maybe empty)."""
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def finish(self) -> str:
        """Flushes what was held back (an incomplete character decodes as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self._decode(self._ids[self._prefix_offset : self._read_offset])
        after = self._decode(self._ids[self._prefix_offset :])
        if len(after) <= len(before) or (after.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        new_text = after[len(before) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += new_text
        return new_text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )


@dataclass
class StopStringMatcher:
    """Finds the first stop string or stop regex in a growing text.

    ``search(text, new_len)`` looks only where a match could newly end: the last
    ``new_len`` characters and the longest stop string's worth before them.
    """

    stop: list[str]
    stop_regex: list[str]

    def __post_init__(self) -> None:
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self._regexes = [re.compile(r) for r in self.stop_regex]

    def search(self, text: str, new_len: int) -> tuple[int, int, str] | None:
        """(start, end, matched) of the earliest match that ends in the new text, or None."""
        best: tuple[int, int, str] | None = None
        window_start = max(0, len(text) - new_len - self._max_stop_len + 1)
        for stop in self.stop:
            pos = text.find(stop, window_start)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, pos + len(stop), stop)
        for regex in self._regexes:
            found = regex.search(text)
            if found and found.end() > found.start() and (best is None or found.start() < best[0]):
                best = (found.start(), found.end(), found.group(0))
        return best

    def held_back(self, text: str) -> int:
        """How many trailing characters could be the start of a stop string (not streamed yet)."""
        for size in range(min(self._max_stop_len - 1, len(text)), 0, -1):
            tail = text[-size:]
            if any(stop.startswith(tail) for stop in self.stop):
                return size
        return 0

