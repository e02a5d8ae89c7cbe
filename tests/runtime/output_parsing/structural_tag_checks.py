"""Checks the tool-call formats' tests share on their structural tags: what a real xgrammar
matcher accepts, and that what it accepts parses back to the calls written."""

from __future__ import annotations

import functools
import json
from typing import Any

import xgrammar as xgr

from radixlm.models.default_model import default_model_path
from radixlm.runtime.grammar.xgrammar_backend import check_constraint
from radixlm.runtime.output_parsing.tool_call_types import (
    FunctionTool,
    ToolCall,
    ToolCallParser,
)

WEATHER = FunctionTool("get_weather", {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
})
TIME = FunctionTool("get_time", {"type": "object", "properties": {}})
TOOLS = [WEATHER, TIME]


@functools.lru_cache(maxsize=64)
def _compiled(tag_text: str) -> xgr.CompiledGrammar:
    check_constraint("structural_tag", tag_text)  # the server takes it as a constraint
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([]), max_threads=1, cache_enabled=False)
    return compiler.compile_structural_tag(tag_text)


def accepts(tag: dict[str, Any], text: str) -> bool:
    """Whether a matcher of ``tag`` takes ``text`` whole and may end there."""
    matcher = xgr.GrammarMatcher(_compiled(json.dumps(tag)), terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


def accepts_prefix(tag: dict[str, Any], text: str) -> bool:
    """Whether a matcher of ``tag`` takes ``text`` as the start of an output."""
    matcher = xgr.GrammarMatcher(_compiled(json.dumps(tag)), terminate_without_stop_token=True)
    return matcher.accept_string(text)


def assert_round_trip(parser: ToolCallParser, tag: dict[str, Any], text: str,
                      calls: list[ToolCall], content: str = "") -> None:
    """``text`` is accepted by ``tag`` and parses to ``calls`` (arguments compared as JSON)
    and ``content``."""
    assert accepts(tag, text), text
    parsed = parser.parse(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == \
        [(c.name, json.loads(c.arguments)) for c in calls]


@functools.lru_cache(maxsize=1)
def _default_model_tokens() -> tuple[xgr.GrammarCompiler, list[bytes]]:
    """A compiler over the default model's tokenizer, and its tokens as bytes."""
    from transformers import AutoTokenizer

    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(default_model_path()))
    return xgr.GrammarCompiler(info, max_threads=1), list(info.decoded_vocab)


def first_tokens(tag: dict[str, Any]) -> list[bytes]:
    """The default model's tokens (as bytes) that a matcher of ``tag`` allows first, compiled
    with that tokenizer as the server compiles it."""
    compiler, vocab = _default_model_tokens()
    compiled = compiler.compile_structural_tag(json.dumps(tag))
    bitmask = xgr.allocate_token_bitmask(1, len(vocab))
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
    allowed = xgr.testing.bitmask_to_bool_mask(bitmask, len(vocab))[0]
    return [vocab[i] for i in allowed.nonzero().flatten().tolist()]


def assert_tokens_open(tag: dict[str, Any], opener: str) -> None:
    """Every first token the default model may write under ``tag`` begins ``opener``."""
    tokens = first_tokens(tag)
    assert tokens, "no token allowed"
    assert all(opener.encode().startswith(token) for token in tokens), tokens
