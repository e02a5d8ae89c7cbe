"""Checks the tool-call formats' tests share on their structural tags: what a real xgrammar
matcher accepts, and that what it accepts parses back to the calls written."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import pytest
import xgrammar as xgr

from radixlm.models.default_model import default_model_path
from radixlm.runtime.grammar.xgrammar_backend import check_constraint
from radixlm.runtime.output_parsing.call_grammar import openai_tools
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


def assert_calls_alone(tag: dict[str, Any], call: str, before: str = "Sure. ",
                       after: str = "\nDone.") -> None:
    """``tag`` takes no empty output and no text before or after ``call``."""
    assert not accepts(tag, "")
    assert not accepts_prefix(tag, "Sure")
    assert not accepts(tag, before + call)
    assert not accepts(tag, call + after)


def assert_builtin_required_tag_lets_text_follow(style: str, call: str, after: str) -> None:
    """xgrammar's builtin ``style`` tag under ``required`` takes text after ``call`` (why a
    format builds its own), though none before it."""
    builtin = xgr.get_builtin_structural_tag(style, tools=openai_tools(TOOLS),
                                             tool_choice="required", reasoning=False)
    assert accepts(builtin.model_dump(), call + after)
    assert not accepts(builtin.model_dump(), "Sure. " + call)


def assert_one_call_without_parallel(parser: ToolCallParser, one: str, two: str,
                                     time_call: str) -> None:
    """Without parallel calls, either tag takes ``one`` call but not ``two``; the auto tag
    takes text before a call (``time_call``)."""
    for at_least_one in (False, True):
        tag = parser.structural_tag(TOOLS, at_least_one=at_least_one, parallel=False)
        assert accepts(tag, one)
        assert not accepts(tag, two)
    assert accepts(parser.structural_tag(TOOLS, False, False), "Text first. " + time_call)


def assert_named_tag_takes_that_function_only(parser: ToolCallParser, time_call: str,
                                              parsed: ToolCall, weather_start: str) -> None:
    """The tag of one function (``get_time``) takes its call, ``time_call``, parsed back to
    ``parsed``, and not the start of another function's call, ``weather_start``."""
    tag = parser.structural_tag([TIME], at_least_one=True, parallel=False)
    assert_round_trip(parser, tag, time_call, [parsed])
    assert not accepts_prefix(tag, weather_start)


def assert_tags_reject_schema_violations(parser: ToolCallParser,
                                         write: Callable[[str], str]) -> None:
    """Either tag rejects ``get_weather`` calls (``write`` gives one for its JSON arguments)
    whose arguments break the schema, and takes one that keeps it."""
    for at_least_one in (False, True):
        tag = parser.structural_tag([WEATHER], at_least_one=at_least_one, parallel=True)
        assert not accepts(tag, write('{"days": 3}'))  # city is required
        assert not accepts_prefix(tag, write('{"city": "P", "days": "three"}'))
        assert not accepts_prefix(tag, write('{"city": "P", "unit": "kelvin"}'))
        oslo = '{"city": "Oslo", "unit": "celsius"}'
        assert_round_trip(parser, tag, write(oslo), [ToolCall("get_weather", oslo)])


def assert_required_tag_needs_a_tool(parser: ToolCallParser) -> None:
    """``required`` with no tools raises; ``auto`` with none takes any text."""
    with pytest.raises(ValueError, match="no tools"):
        parser.structural_tag([], at_least_one=True, parallel=True)
    assert accepts(parser.structural_tag([], at_least_one=False, parallel=True), "any text")


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


def assert_default_model_opens_only_calls(parser: ToolCallParser, opener: str) -> None:
    """Under ``required`` the default model's first token begins ``opener``; under ``auto``
    it may write most tokens."""
    assert_tokens_open(parser.structural_tag(TOOLS, at_least_one=True, parallel=True), opener)
    assert len(first_tokens(parser.structural_tag(TOOLS, False, True))) > 1000
