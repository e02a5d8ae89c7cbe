"""The Llama 3.x JSON tool-call format (Llama 3.1, 3.2, 3.3 with JSON tool calling): a call
is a JSON object whose first key is ``name``,

    {"name": "get_weather", "parameters": {"city": "Paris"}}

with the arguments under ``parameters`` (or ``arguments``), optionally after the
``<|python_tag|>`` marker; several calls are separated by ``;``.

A block starts at ``<|python_tag|>``, at a ``;``, or at a ``{``; it is a call only when what
follows (after whitespace) is an object of two keys: ``name`` (a string) first, then one of
``parameters``/``arguments`` (an object). So ordinary JSON in text (a config, an object
whose keys differ) stays content, given as soon as its first keys show it is no call; a
``;`` or marker not followed by a call is content too. An object of exactly a call's shape
is a call wherever it stands, even inside other JSON: the rule xgrammar's Llama structural
tag applies (a call may begin anywhere in the text).
"""

from __future__ import annotations

import re
from typing import Any

from xgrammar import structural_tag as st

from radixlm.runtime.output_parsing.block_parser import (
    INCOMPLETE,
    INVALID,
    Block,
    BlockToolCallParser,
    Undecided,
    partial_suffix,
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

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"
FIRST_KEY = '"name"'
ARGUMENT_KEYS = ("parameters", "arguments")
QUOTED_KEYS = tuple(f'{key}"' for key in ARGUMENT_KEYS)
LONGEST_KEY = max(QUOTED_KEYS, key=len)
# A name (a string) written and a second key begun: up to that key's opening quote. The match,
# once there is one, is the same for every longer text, so what it decides stays decided.
_NAME_THEN_KEY = re.compile(r'\{\s*"name"\s*:\s*"(?:[^"\\]|\\.)*"\s*,\s*"')

# How the constrained form writes a call (xgrammar's Llama tag writes it so).
CALL_BEGIN = '{"name": "'
PARAMETERS_BEGIN = '", "parameters": '
CALL_END = "}"


class Llama3ToolCallParser(BlockToolCallParser):
    """Llama 3.x JSON calls (see module docstring)."""

    name = "llama3"

    def __init__(self) -> None:
        self._scans = JsonScans()  # a stream's growing block is read once

    def find_block(self, text: str, start: int) -> tuple[int | None, int]:
        found = [at for at in (text.find(PYTHON_TAG, start), text.find("{", start),
                               text.find(SEPARATOR, start)) if at >= 0]
        if found:
            return min(found), 0
        return None, partial_suffix(text, PYTHON_TAG)

    def match_block(self, text: str, start: int) -> Block | Undecided:
        if text.startswith(PYTHON_TAG, start):
            body = skip_whitespace(text, start + len(PYTHON_TAG))
        elif text[start] == SEPARATOR:
            body = skip_whitespace(text, start + 1)
        else:
            body = start
        if body >= len(text):
            return INCOMPLETE
        if text[body] != "{":
            return INVALID
        # Most braces in text open no call: decide those on their first keys, not their end.
        key = skip_whitespace(text, body + 1)
        written = text[key:key + len(FIRST_KEY)]
        if written != FIRST_KEY:
            return INCOMPLETE if FIRST_KEY.startswith(written) else INVALID
        second = _NAME_THEN_KEY.match(text, body)
        if second is not None:
            written = text[second.end():second.end() + len(LONGEST_KEY)]
            if not any(k.startswith(written) or written.startswith(k) for k in QUOTED_KEYS):
                return INVALID
        span = self._scans.scan(text, body)
        if not isinstance(span, JsonSpan):
            return span
        for arguments_key in ARGUMENT_KEYS:
            call = call_from_object(text, body, span, frozenset({"name", arguments_key}),
                                    arguments_key)
            if call is not None:
                return Block([call], span.end)
        return INVALID

    def structural_tag(self, tools: list[FunctionTool], at_least_one: bool,
                       parallel: bool) -> dict[str, Any]:
        if not at_least_one:
            # xgrammar's Llama tag: free text, a call wherever '{"name": ' begins.
            return builtin_auto_tag("llama", tools, parallel)
        tags = json_call_tags(tools, CALL_BEGIN, PARAMETERS_BEGIN, CALL_END)
        return st.StructuralTag(format=calls_only(tags, SEPARATOR, parallel)).model_dump()
