"""Jump-forward decoding: where the grammar admits one continuation only (a fixed key, a
closing brace and a comma), append its tokens at once instead of decoding them one by one.

The forced text comes from the matcher as a string; turning it into tokens is where care is
needed. Tokenizing it alone would glue the model's last token and the forced text at an
unnatural boundary (``"`` + ``name": "`` where the model would write ``"name`` and ``":``).
So the last sampled token's text is re-tokenized together with the forced text, as the
model's own tokenizer would split it; when that changes the last token, the last token is
replaced (it has no KV yet: a running request's last token is computed by the next
forward pass, so nothing needs to be recomputed). The final token is left for the model
when it is a strict prefix of a longer token (``Ġ"`` of ``Ġ"J``): the text that follows
may merge with it, and the model should choose that split.

The matcher is the judge: every token appended has been accepted by it, so the text is
always what the grammar accepts; if the re-tokenization does not fit (a tokenizer that does
not round-trip), nothing is jumped and the matcher is left as it was.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from radixlm.runtime.grammar_backend import GrammarMatcher

REPLACEMENT_CHAR = "\ufffd"


class JumpForward:
    """Computes jump-forward tokens over one tokenizer (built once per scheduler)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self._extendable: frozenset[int] | None = None

    def extendable(self) -> frozenset[int]:
        """Token ids whose text is a strict prefix of another token's text (computed once,
        on the vocabulary's own token strings, where prefixes of text are prefixes of
        strings)."""
        if self._extendable is None:
            vocab = self.tokenizer.get_vocab()
            prefixes = {piece[:end] for piece in vocab for end in range(1, len(piece))}
            self._extendable = frozenset(i for piece, i in vocab.items() if piece in prefixes)
        return self._extendable

    def jump(self, matcher: GrammarMatcher, last_token: int, limit: int) -> list[int] | None:
        """The tokens that replace ``last_token`` (just sampled and accepted by ``matcher``)
        at the end of the output: its own re-tokenization together with the forced text.

        At most ``limit`` tokens. Returns None when there is nothing to jump; the matcher is
        then unchanged. Otherwise the matcher has accepted exactly the returned tokens in
        place of ``last_token`` (the first may differ from it; at least one token beyond the
        sampled text is gained).
        """
        if limit < 1:
            return None
        forced = matcher.jump_forward_string()
        if not forced:
            return None
        last_text = self._decode(last_token)
        if REPLACEMENT_CHAR in last_text or not last_text:  # part of a character: keep it
            tokens = [last_token] + self._encode(forced)
        else:
            tokens = self._encode(last_text + forced)
        if len(tokens) > 1 and tokens[-1] in self.extendable():
            tokens.pop()
        tokens = tokens[:limit]
        if not tokens or tokens == [last_token]:
            return None
        if tokens[0] != last_token and len(self._decode(*tokens)) <= len(last_text):
            return None  # the sampled text itself would be cut back: leave it
        return tokens if self._accept(matcher, last_token, tokens) else None

    def _accept(self, matcher: GrammarMatcher, last_token: int, tokens: list[int]) -> bool:
        """Moves ``matcher`` from after ``last_token`` to after ``tokens``; on a rejected
        token, restores it and returns False."""
        replaced = tokens[0] != last_token
        if replaced:
            matcher.rollback(1)
        for accepted, token in enumerate(tokens[0 if replaced else 1 :]):
            if not matcher.accept_token(token):
                matcher.rollback(accepted)
                if replaced:
                    matcher.accept_token(last_token)
                return False
        return True

    def _decode(self, *tokens: int) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)
