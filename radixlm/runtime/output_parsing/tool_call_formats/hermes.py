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

from typing import Any

from xgrammar import structural_tag as st

from radixlm.runtime.output_parsing.block_parser import (
    INCOMPLETE,
    INVALID,
    Block,
    MarkerBlockParser,
    Undecided,
)
from radixlm.runtime.output_parsing.call_grammar import (
    builtin_auto_tag,
    calls_only,
    json_call_tags,
)
from radixlm.runtime.output_parsing.tool_call_formats.json_call import call_from_object
from radixlm.runtime.output_parsing.tool_call_formats.json_prefix import (
    JsonScans,
    JsonSpan,
    skip_whitespace,
)
from radixlm.runtime.output_parsing.tool_call_types import FunctionTool

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
CALL_KEYS = frozenset({"name", "arguments"})

# How the constrained form writes a call (Qwen's own chat template writes it so).
CALL_BEGIN = OPEN + '\n{"name": "'
ARGUMENTS_BEGIN = '", "arguments": '
CALL_END = "}\n" + CLOSE
CALL_SEPARATOR = "\n"


class HermesToolCallParser(MarkerBlockParser):
    """``<tool_call>`` JSON ``</tool_call>`` blocks (see module docstring)."""

    name = "qwen25"
    marker = OPEN

    def __init__(self) -> None:
        self._scans = JsonScans()  # a stream's growing block is read once

    def match_block(self, text: str, start: int) -> Block | Undecided:
        body = skip_whitespace(text, start + len(OPEN))
        span = self._scans.scan_object(text, body)
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
            return builtin_auto_tag("qwen_3", tools, parallel)
        tags = json_call_tags(tools, CALL_BEGIN, ARGUMENTS_BEGIN, CALL_END)
        return st.StructuralTag(format=calls_only(tags, CALL_SEPARATOR, parallel)).model_dump()
