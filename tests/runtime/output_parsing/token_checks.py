"""A structural tag under the default model's own tokenizer: the tokens that write a text,
fed one by one to a matcher compiled against that vocabulary, as a server's decode would."""

from __future__ import annotations

import functools
import json
from typing import Any

import xgrammar as xgr
from structural_tag_checks import TOOLS

from radixlm.runtime.output_parsing.tool_call_types import ToolCallParser


@functools.cache
def _tokenizer_and_compiler() -> tuple[Any, xgr.GrammarCompiler]:
    from transformers import AutoTokenizer

    from radixlm.models.default_model import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    info = xgr.TokenizerInfo.from_huggingface(tokenizer)
    return tokenizer, xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def accepts_tokens(tag: dict[str, Any], text: str) -> bool:
    """Whether the matcher of ``tag`` takes the default model's tokens of ``text``, then its
    end-of-sequence token, and ends there."""
    tokenizer, compiler = _tokenizer_and_compiler()
    matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(json.dumps(tag)))
    tokens = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    return all(matcher.accept_token(token) for token in tokens) and matcher.is_terminated()


def assert_tokens_take_calls_alone(parser: ToolCallParser, calls: str, call: str) -> None:
    """The ``required`` tag takes the default model's tokens of ``calls``, and not of text
    before ``call``."""
    tag = parser.structural_tag(TOOLS, at_least_one=True, parallel=True)
    assert accepts_tokens(tag, calls)
    assert not accepts_tokens(tag, "Sure. " + call)
