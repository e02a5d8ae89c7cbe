"""Grammar backends by name: the scheduler's compiler and the entry's constraint check.

The one place that knows the implementations, so the backend contract
(``grammar_backend.py``) never imports one of them.
"""

from __future__ import annotations

from collections.abc import Callable

from radixlm.runtime.grammar.grammar_backend import GrammarBackend
from radixlm.runtime.server_args import GRAMMAR_BACKENDS


def make_grammar_backend(name: str, tokenizer, vocab_size: int,
                         stop_token_ids: set[int]) -> GrammarBackend:
    """The backend called ``name`` (one of ``GRAMMAR_BACKENDS``) for this tokenizer."""
    if name == "xgrammar":
        from radixlm.runtime.grammar.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer, vocab_size, stop_token_ids)
    raise ValueError(f"grammar_backend must be one of {GRAMMAR_BACKENDS}, got {name!r}")


def constraint_checker(name: str) -> Callable[[str, str], None]:
    """``check(kind, text)`` of the backend called ``name``: raises ``ValueError`` naming the
    problem when that backend cannot parse the constraint. Needs no tokenizer, so requests
    are checked where they enter, before anything is queued."""
    if name == "xgrammar":
        from radixlm.runtime.grammar.xgrammar_backend import check_constraint

        return check_constraint
    raise ValueError(f"grammar_backend must be one of {GRAMMAR_BACKENDS}, got {name!r}")
