"""Jump-forward decoding: where the grammar admits one continuation only (a fixed key, a
closing brace and a comma), append its tokens at once instead of decoding them one by one.

The forced text comes from the matcher as a string; turning it into tokens is where care is
needed, because the model reads tokens, not text. The last sampled token is re-tokenized
together with the forced text, so that the boundary between them falls where the model's
tokenizer puts it (``Ġ"`` + ``name": "`` gives ``Ġ"``, ``name``, ``":``, ``Ġ"``), and the
forced text is split as the tokenizer splits it. When that re-tokenization would change the
sampled token itself (``{`` + ``"name"`` -> ``{"``, ``name``...), the sampled token is kept,
since the model chose it, and the forced text is tokenized on its own after it: measured on
the default model at temperature 0 this keeps the text of a run without jump-forward far
more often (11 of 16 fixed-key JSON prompts, against 3 of 16 when the token is replaced).
The final token is left for the model when it is a strict prefix of a longer token
(``Ġ"`` of ``Ġ"J``): the text that follows may merge with it, and the model should choose
that split.

The matcher is the judge: every token appended has been accepted by it, so the text is
always what the grammar accepts; if the tokens do not fit (a tokenizer that does not
round-trip, text that spells a special token), nothing is jumped and the matcher is left as
it was.

The work is bounded: the forced text is at most what the matcher bounds it to (xgrammar's
walk has no limit of its own; ``grammar_bounds.py`` bounds it from the grammar, and the
matcher returns "" past ``MAX_FORCED_BYTES``), and only the part that ``limit`` tokens can
cover (``limit + 1`` times the longest token's characters) is tokenized.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from radixlm.runtime.detokenizer.incremental_detokenizer import REPLACEMENT_CHAR
from radixlm.runtime.grammar.grammar_backend import GrammarMatcher


class JumpForward:
    """Computes jump-forward tokens over one tokenizer (built once per scheduler)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        self._extendable = extendable_mask(vocab)  # now, not mid-step later
        self.longest_token = max(map(len, vocab), default=1)
        """Characters of the longest token as the vocabulary spells it (no fewer than the
        characters of text it decodes to)."""

    def is_extendable(self, token_id: int) -> bool:
        """Whether the token's text is a strict prefix of another token's text."""
        return token_id < len(self._extendable) and self._extendable[token_id] == 1

    def jump(self, matcher: GrammarMatcher, last_token: int, limit: int) -> list[int] | None:
        """The tokens that end the output after ``matcher`` accepted ``last_token`` (just
        sampled): ``last_token`` itself, then the forced text's tokens.

        At most ``limit`` tokens. Returns None when there is nothing to jump; the matcher is
        then unchanged. Otherwise the matcher has accepted every returned token.
        """
        if limit < 2:
            return None
        forced = matcher.jump_forward_string()
        if not forced:
            return None
        covered = (limit + 1) * self.longest_token  # more than ``limit`` tokens can cover
        cut = len(forced) > covered
        forced = forced[:covered]
        last_text = self._decode(last_token)
        tokens = []
        if last_text and REPLACEMENT_CHAR not in last_text:  # else part of a character
            tokens = self._encode(last_text + forced)
        if not tokens or tokens[0] != last_token:
            tokens = [last_token] + self._encode(forced)
        if cut or (len(tokens) > 2 and self.is_extendable(tokens[-1])):
            tokens.pop()  # cut: the last token may be part of a longer one
        tokens = tokens[:limit]
        if len(tokens) < 2:
            return None
        for accepted, token in enumerate(tokens[1:]):
            if not matcher.accept_token(token):
                matcher.rollback(accepted)
                return None
        return tokens

    def _decode(self, *tokens: int) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


def extendable_mask(vocab: dict[str, int]) -> bytearray:
    """One byte a token id, 1 where the token's string is a strict prefix of another token's
    (on the vocabulary's own strings, where prefixes of text are prefixes of strings).

    Sorted, the strings that start with a piece follow it at once, so a piece is a strict
    prefix of some other piece exactly when it is one of the next. (Not a set of every
    prefix of every piece: millions of strings for a 262k vocabulary, whose freed memory
    stayed with the scheduler; and bytes, not a set of ids, for the same reason.)
    """
    mask = bytearray(max(vocab.values(), default=-1) + 1)
    pieces = sorted(vocab)
    for piece, following in zip(pieces, pieces[1:], strict=False):
        if following.startswith(piece):
            mask[vocab[piece]] = 1
    return mask
