"""Qwen3-Coder's tool calls (``--tool-call-parser qwen3_coder``): one call per block, its
arguments written as XML-like parameters, as the model's chat template writes them::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Reading a block: whitespace is allowed between the tags; a function's name and a parameter's
key end at the first ``>`` and hold no ``<`` or newline; a value runs to the first
``</parameter>``, less the one newline the template writes on each side. Anything else (a
tag out of place, a repeated key, a block never closed) makes the block content. Calls in
several blocks come one block each, so text between blocks (the template's newline) is
content.

Values: the parser is not given the request's tools, so a value is typed by its own text, not
by the schema as Qwen's parser does: a value that loads as JSON (a number, ``true``, ``null``,
an object, an array, a quoted string) is that JSON value; anything else is the string as
written. So a string-typed parameter written ``42`` arrives as the number 42. ``arguments``
is ``json.dumps`` of the parameters, in the order written.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from xgrammar import structural_tag as xst

from radixlm.runtime.output_parsing.block_parser import (
    Block,
    MarkerBlockParser,
    Undecided,
)
from radixlm.runtime.output_parsing.call_grammar import calls_only
from radixlm.runtime.output_parsing.tool_call_formats.block_reading import (
    BlockCursor,
    json_object_text,
    read_block,
)
from radixlm.runtime.output_parsing.tool_call_types import FunctionTool, ToolCall

TOOL_CALL = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"


class Qwen3CoderToolCallParser(MarkerBlockParser):
    """Blocks ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function>
    </tool_call>`` (see module docstring)."""

    name: ClassVar[str] = "qwen3_coder"
    marker: ClassVar[str] = TOOL_CALL

    def match_block(self, text: str, start: int) -> Block | Undecided:
        return read_block(text, start, _read_call)

    def structural_tag(self, tools: list[FunctionTool], at_least_one: bool,
                       parallel: bool) -> dict[str, Any]:
        """Calls as the chat template writes them, parameters constrained by xgrammar's
        ``qwen_xml`` style of each function's schema. Free text may come before and between
        calls (after the last only when ``parallel``); with ``at_least_one`` the output is
        calls alone, a newline between two. xgrammar's own ``qwen_3_coder`` tag is not used:
        its ``required`` form still lets text follow the first call, and it wants a blank
        line where the template writes no parameters."""
        tags = [
            xst.TagFormat(begin=f"{TOOL_CALL}\n{FUNCTION}{tool.name}>\n",
                          content=_parameters_format(tool),
                          end=f"{FUNCTION_END}\n{TOOL_CALL_END}")
            for tool in tools
        ]
        if at_least_one:
            calls: Any = calls_only(tags, "\n", parallel)
        elif tags:
            calls = xst.TriggeredTagsFormat(
                triggers=[f"{TOOL_CALL}\n{FUNCTION}"], tags=tags, stop_after_first=not parallel)
        else:
            calls = xst.AnyTextFormat()
        return xst.StructuralTag(format=calls).model_dump()


def _parameters_format(tool: FunctionTool) -> Any:
    """A function's parameters, each followed by the template's newline; a function whose
    schema names no properties takes none (the template then writes ``</function>`` on the
    line after the name)."""
    if not tool.parameters.get("properties"):
        return xst.ConstStringFormat(value="")
    return xst.SequenceFormat(elements=[
        xst.JSONSchemaFormat(json_schema=tool.parameters, style="qwen_xml"),
        xst.ConstStringFormat(value="\n"),
    ])


def _read_call(cursor: BlockCursor) -> Block:
    cursor.literal(TOOL_CALL)
    cursor.skip_space()
    cursor.literal(FUNCTION)
    name = cursor.until(">", forbidden=("<", "\n"))
    cursor.fail_unless(name != "" and name == name.strip())
    arguments: dict[str, Any] = {}
    while True:
        cursor.skip_space()
        tag, _ = cursor.one_of(PARAMETER, FUNCTION_END)
        if tag == 1:
            break
        key = cursor.until(">", forbidden=("<", "\n"))
        cursor.fail_unless(key != "" and key not in arguments)
        arguments[key] = parameter_value(_unwrapped(cursor.until(PARAMETER_END)))
    cursor.skip_space()
    cursor.literal(TOOL_CALL_END)
    text = json_object_text(arguments)
    cursor.fail_unless(text is not None)
    return Block([ToolCall(name, text)], cursor.pos)


def _unwrapped(value: str) -> str:
    """A value less the newline the template writes on each side of it."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def parameter_value(text: str) -> Any:
    """A parameter's value: the JSON value ``text`` loads as, else ``text`` itself (see
    module docstring); text whose value JSON cannot write back (``NaN``, ``1e999``, a lone
    surrogate) stays text."""
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return text
    return text if json_object_text({"value": value}) is None else value


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")
