"""The Hermes tool-call format (Qwen2.5, Qwen3, NousResearch Hermes): each call is a block

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Whitespace around the JSON is free; several blocks are parallel calls; text before, between
and after blocks is content, byte for byte. A block is a call only if its JSON is an object
with exactly the keys ``name`` (a string) and ``arguments`` (an object); anything else leaves
the block's text as content. SGLang names the parser ``qwen25`` (and ``qwen``); vLLM names
it ``hermes``.
"""

from __future__ import annotations

import json
from typing import Any

import xgrammar as xgr
from xgrammar import structural_tag as st

from radixlm.runtime.output_parsing.block_parser import (
    INCOMPLETE,
    INVALID,
    Block,
    BlockToolCallParser,
    Undecided,
    partial_suffix,
)
from radixlm.runtime.output_parsing.call_grammar import calls_only, json_call_tag
from radixlm.runtime.output_parsing.tool_call_formats.json_prefix import (
    JsonScans,
    JsonSpan,
    skip_whitespace,
)
from radixlm.runtime.output_parsing.tool_call_types import FunctionTool, ToolCall

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
CALL_KEYS = frozenset({"name", "arguments"})

# How the constrained form writes a call (Qwen's own chat template writes it so).
CALL_BEGIN = OPEN + '\n{"name": "'
ARGUMENTS_BEGIN = '", "arguments": '
CALL_END = "}\n" + CLOSE
CALL_SEPARATOR = "\n"


def call_from_object(text: str, start: int, span: JsonSpan, keys: frozenset[str],
                     arguments_key: str = "arguments") -> ToolCall | None:
    """The call that the JSON object ``text[start:span.end]`` writes, or None if it is not
    one: its keys are a subset of ``keys`` holding ``name`` (a string) and ``arguments_key``
    (an object, kept as the model's own text)."""
    value = json.loads(text[start:span.end])
    if not isinstance(value, dict) or not set(value) <= keys:
        return None
    name, arguments = value.get("name"), span.member_text(text, arguments_key)
    if not isinstance(name, str) or not name or not isinstance(value.get(arguments_key), dict):
        return None
    return ToolCall(name, arguments)


def openai_tools(tools: list[FunctionTool]) -> list[dict[str, Any]]:
    """``tools`` as xgrammar's builtin structural tags take them."""
    return [tool.openai_tool() for tool in tools]


class HermesToolCallParser(BlockToolCallParser):
    """``<tool_call>`` JSON ``</tool_call>`` blocks (see module docstring)."""

    name = "qwen25"

    def __init__(self) -> None:
        self._scans = JsonScans()  # a stream's growing block is read once

    def find_block(self, text: str, start: int) -> tuple[int | None, int]:
        found = text.find(OPEN, start)
        if found >= 0:
            return found, 0
        return None, partial_suffix(text, OPEN)

    def match_block(self, text: str, start: int) -> Block | Undecided:
        body = skip_whitespace(text, start + len(OPEN))
        if body >= len(text):
            return INCOMPLETE
        if text[body] != "{":
            return INVALID
        span = self._scans.scan(text, body)
        if not isinstance(span, JsonSpan):
            return span
        call = call_from_object(text, body, span, CALL_KEYS)
        if call is None:
            return INVALID
        close = skip_whitespace(text, span.end)
        if text.startswith(CLOSE, close):
            return Block([call], close + len(CLOSE))
        if CLOSE.startswith(text[close:close + len(CLOSE)]):
            return INCOMPLETE  # what is there is a prefix of the closing marker
        return INVALID

    def structural_tag(self, tools: list[FunctionTool], at_least_one: bool,
                       parallel: bool) -> dict[str, Any]:
        if not at_least_one:
            # xgrammar's Qwen 3 tag writes the same blocks, text around them free.
            return xgr.get_builtin_structural_tag(
                "qwen_3", tools=openai_tools(tools), tool_choice="auto", reasoning=False,
                parallel_tool_calls=parallel).model_dump()
        tags = [json_call_tag(CALL_BEGIN + tool.name + ARGUMENTS_BEGIN, tool, CALL_END)
                for tool in tools]
        return st.StructuralTag(format=calls_only(tags, CALL_SEPARATOR, parallel)).model_dump()
