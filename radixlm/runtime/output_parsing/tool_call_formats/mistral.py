"""The Mistral tool-call formats, both read by one parser:

- the array form (Mistral 7B v0.3, Nemo, Small up to 3.1):
  ``[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]``, each
  element an object with ``name`` (a string), ``arguments`` (an object) and optionally
  ``id`` (a string), nothing else;
- the compact form (Small 3.2, Magistral, Devstral): ``[TOOL_CALLS]get_weather[ARGS]{...}``,
  optionally ``[TOOL_CALLS]name[CALL_ID]abc123XYZ[ARGS]{...}``, one call per marker.

A ``[TOOL_CALLS]`` not followed by either form is content, as is everything around blocks.
The structural tag constrains to the array form, as SGLang's Mistral parser does.
"""

from __future__ import annotations

import re
from typing import Any

from xgrammar import structural_tag as st

from radixlm.runtime.output_parsing.block_parser import (
    INCOMPLETE,
    INVALID,
    Block,
    MarkerBlockParser,
    Undecided,
)
from radixlm.runtime.output_parsing.call_grammar import calls_only, json_call_tags
from radixlm.runtime.output_parsing.tool_call_formats.block_reading import literal_end
from radixlm.runtime.output_parsing.tool_call_formats.json_call import call_from_object
from radixlm.runtime.output_parsing.tool_call_formats.json_prefix import (
    JsonScans,
    JsonSpan,
    scan_json,
    skip_whitespace,
)
from radixlm.runtime.output_parsing.tool_call_types import FunctionTool, ToolCall

MARKER = "[TOOL_CALLS]"
CALL_ID = "[CALL_ID]"
ARGS = "[ARGS]"
ELEMENT_KEYS = frozenset({"name", "arguments", "id"})
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")
_ID = re.compile(r"[A-Za-z0-9]*")

# How the constrained (array) form writes calls.
ARRAY_BEGIN = MARKER + " ["
ARRAY_END = "]"
CALL_BEGIN = '{"name": "'
ARGUMENTS_BEGIN = '", "arguments": '
CALL_END = "}"
ELEMENT_SEPARATOR = ", "


class MistralToolCallParser(MarkerBlockParser):
    """``[TOOL_CALLS]`` blocks in the array or the compact form (see module docstring)."""

    name = "mistral"
    marker = MARKER

    def __init__(self) -> None:
        self._scans = JsonScans()  # a stream's growing block is read once

    def match_block(self, text: str, start: int) -> Block | Undecided:
        body = skip_whitespace(text, start + len(MARKER))
        if body >= len(text):
            return INCOMPLETE
        if text[body] == "[":
            return _array_block(text, body, self._scans)
        return _compact_block(text, start + len(MARKER), self._scans)

    def structural_tag(self, tools: list[FunctionTool], at_least_one: bool,
                       parallel: bool) -> dict[str, Any]:
        if not tools:
            if at_least_one:
                raise ValueError("at least one tool call is required, but no tools are given")
            return st.StructuralTag(format=st.AnyTextFormat()).model_dump()
        tags = json_call_tags(tools, CALL_BEGIN, ARGUMENTS_BEGIN, CALL_END)
        block = st.TagFormat(begin=ARRAY_BEGIN, content=calls_only(tags, ELEMENT_SEPARATOR,
                                                                   parallel), end=ARRAY_END)
        if at_least_one:
            return st.StructuralTag(format=block).model_dump()
        # Free text until the marker; the one block of calls ends the output.
        free = st.TriggeredTagsFormat(triggers=[MARKER], tags=[block], stop_after_first=True)
        return st.StructuralTag(format=free).model_dump()


def _array_block(text: str, body: int, scans: JsonScans) -> Block | Undecided:
    """``[{...}, ...]`` at ``body``: one or more call objects."""
    span = scans.scan(text, body)
    if not isinstance(span, JsonSpan):
        return span
    calls: list[ToolCall] = []
    for _, begin, _ in span.members:
        element = scan_json(text, begin)
        if text[begin] != "{" or not isinstance(element, JsonSpan):
            return INVALID
        call = call_from_object(text, begin, element, ELEMENT_KEYS)
        if call is None:
            return INVALID
        calls.append(call)
    return Block(calls, span.end) if calls else INVALID


def _compact_block(text: str, pos: int, scans: JsonScans) -> Block | Undecided:
    """``name[ARGS]{...}`` (or ``name[CALL_ID]id[ARGS]{...}``) right after the marker."""
    name_end = _NAME.match(text, pos).end()
    if name_end >= len(text):
        return INCOMPLETE
    if name_end == pos:
        return INVALID
    name = text[pos:name_end]
    after = literal_end(text, name_end, CALL_ID)
    if after is INCOMPLETE:
        return INCOMPLETE
    if isinstance(after, int):
        id_end = _ID.match(text, after).end()
        if id_end >= len(text):
            return INCOMPLETE
        if id_end == after:
            return INVALID
        name_end = id_end
    args = literal_end(text, name_end, ARGS)
    if isinstance(args, Undecided):
        return args
    body = skip_whitespace(text, args)
    span = scans.scan_object(text, body)
    if not isinstance(span, JsonSpan):
        return span
    return Block([ToolCall(name, text[body:span.end])], span.end)
