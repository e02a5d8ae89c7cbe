"""Fixtures of the sampling tests."""

from __future__ import annotations

import pytest
from tiny_models import tiny_tokenizer

from radixlm.runtime.grammar.factory import make_grammar_backend

EOS = 0
"""The end-of-sequence id the sampling tests' grammars and samplers use."""


@pytest.fixture(scope="module")
def grammar_backend():
    """An xgrammar backend over the tiny tokenizer (EOS 0), for one module."""
    tokenizer = tiny_tokenizer()
    backend = make_grammar_backend("xgrammar", tokenizer, len(tokenizer), {EOS})
    yield backend
    backend.shutdown()
