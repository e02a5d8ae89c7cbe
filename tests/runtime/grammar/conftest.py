"""Fixtures of the grammar tests: an xgrammar backend over the tiny tokenizer."""

from __future__ import annotations

import pytest
from tiny_models import tiny_tokenizer

from radixlm.runtime.grammar.xgrammar_backend import XGrammarBackend

EOS = 0
"""The tiny tokenizer's end-of-sequence id (the backend's stop token)."""


@pytest.fixture(scope="module")
def backend():
    tokenizer = tiny_tokenizer()
    backend = XGrammarBackend(tokenizer, len(tokenizer), {EOS})
    yield backend
    backend.shutdown()
