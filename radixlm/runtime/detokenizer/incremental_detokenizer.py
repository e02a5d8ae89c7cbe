"""Incremental detokenization of one request's output.

Decoding token by token breaks where one character spans several tokens (UTF-8 split
across byte-level BPE tokens) and where a tokenizer's spacing depends on the previous
token (SentencePiece's leading "▁"). So each step decodes a short window that begins a few
tokens back and emits only the text past what was already emitted, and holds text back
while it ends in an incomplete character (U+FFFD).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixlm.runtime.detokenizer.text_decoder import TextDecoder

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

    tokenizer: TextDecoder
    prompt_ids: list[int]
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    text: str = ""
    before_last_feed: int = 0
    """The length of ``text`` before the last ``feed`` (where a stop token's text starts,
    when that token was fed last and alone)."""
    _ids: list[int] = field(default_factory=list)
    _prefix_offset: int = 0
    _read_offset: int = 0

    def __post_init__(self) -> None:
        self._ids = list(self.prompt_ids[-CONTEXT_TOKENS:])
        self._read_offset = len(self._ids)

    def feed(self, token_ids: list[int]) -> str:
        """Adds output tokens; returns the newly completed text (maybe empty)."""
        self.before_last_feed = len(self.text)
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
