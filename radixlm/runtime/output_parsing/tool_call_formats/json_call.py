"""A tool call written as one JSON object, ``{"name": ..., "arguments": {...}}``: the shape
the Hermes, Mistral (array form) and Llama 3 formats share, each with its own keys.

A call's arguments are kept as the model's own text (the member's span), not re-serialized,
so a stream and a whole parse give byte-identical arguments.
"""

from __future__ import annotations

import json

from radixlm.runtime.output_parsing.tool_call_formats.json_prefix import JsonSpan
from radixlm.runtime.output_parsing.tool_call_types import ToolCall


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
