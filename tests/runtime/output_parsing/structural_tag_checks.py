"""Checks the tool-call formats' tests share on their structural tags: what a real xgrammar
matcher accepts, and that what it accepts parses back to the calls written."""

from __future__ import annotations

import functools
import json
from typing import Any

import xgrammar as xgr

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
