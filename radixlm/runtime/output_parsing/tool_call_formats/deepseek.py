"""DeepSeek's tool calls: V3 (``--tool-call-parser deepseekv3``, also DeepSeek-R1) and V3.1
(``deepseekv31``, also V3.2-Exp). Both wrap one or more calls in a block of the models'
special tokens, as their chat templates write them::

    V3:   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
          ```json
          {"city": "Paris"}
          ```<｜tool▁call▁end｜>
          <｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>
    V3.1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{"city": "Paris"}
          <｜tool▁call▁end｜><｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(the V3.1 lines are one line; the template writes nothing between calls, V3's a newline).

Reading a block: whitespace is allowed between calls and around the JSON; a name holds no
newline and no ``<｜``; the arguments run to the call's end marker, must load as a JSON
object, and are kept as the model wrote them (less surrounding whitespace). A block with no
call, a call out of form, or a block never closed with ``<｜tool▁calls▁end｜>`` is content,
marker and all. Arguments never hold another block or call marker, so a call whose end
marker is missing is given up as soon as the next marker appears.
"""

from __future__ import annotations

import json
from abc import abstractmethod
from typing import Any, ClassVar

from xgrammar import structural_tag as xst

from radixlm.runtime.output_parsing.block_parser import (
    Block,
    MarkerBlockParser,
    Undecided,
)
from radixlm.runtime.output_parsing.call_grammar import calls_only, json_call_tag
from radixlm.runtime.output_parsing.tool_call_formats.block_reading import (
    BlockCursor,
    read_block,
)
from radixlm.runtime.output_parsing.tool_call_types import FunctionTool, ToolCall

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
SPECIAL = "<｜"
"""How every DeepSeek special token begins; none belongs in a name."""
MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN)
"""Markers that never belong in a call's arguments."""


class DeepSeekToolCallParser(MarkerBlockParser):
    """The block both versions share (see module docstring); a version reads and writes one
    call (``read_call``, ``call_tag``)."""

    marker: ClassVar[str] = CALLS_BEGIN
    separator: ClassVar[str]
    """What the chat template writes between two calls."""

    def match_block(self, text: str, start: int) -> Block | Undecided:
        return read_block(text, start, self._read_calls)

    def _read_calls(self, cursor: BlockCursor) -> Block:
        cursor.literal(CALLS_BEGIN)
        calls: list[ToolCall] = []
        while True:
            cursor.skip_space()
            _, marker = cursor.one_of(CALL_BEGIN, CALLS_END)
            if marker == CALLS_END:
                cursor.fail_unless(bool(calls))
                return Block(calls, cursor.pos)
            calls.append(self.read_call(cursor))

    @abstractmethod
    def read_call(self, cursor: BlockCursor) -> ToolCall:
        """Reads one call after its ``<｜tool▁call▁begin｜>``, through its end marker."""

    @abstractmethod
    def call_tag(self, tool: FunctionTool) -> xst.TagFormat:
        """One call of ``tool``, from its ``<｜tool▁call▁begin｜>`` to its end marker."""

    def structural_tag(self, tools: list[FunctionTool], at_least_one: bool,
                       parallel: bool) -> dict[str, Any]:
        """Calls in one block as the chat template writes them, arguments constrained by
        each function's schema; in free text a block may open at any point (again after a
        block, when ``parallel``); with ``at_least_one`` the output is one block alone. This
        is xgrammar's own ``deepseek_r1`` (V3) or ``deepseek_v3_1`` tag, save that free text
        is not kept from holding ``<think>``."""
        if not tools:
            if at_least_one:
                raise ValueError("at least one tool call is required, but no tools are given")
            return xst.StructuralTag(format=xst.AnyTextFormat()).model_dump()
        block = xst.TagFormat(
            begin=CALLS_BEGIN,
            content=calls_only([self.call_tag(tool) for tool in tools], self.separator,
                               parallel),
            end=CALLS_END,
        )
        if at_least_one:
            return xst.StructuralTag(format=block).model_dump()
        return xst.StructuralTag(format=xst.TriggeredTagsFormat(
            triggers=[CALLS_BEGIN], tags=[block], stop_after_first=not parallel)).model_dump()


class DeepSeekV3ToolCallParser(DeepSeekToolCallParser):
    """DeepSeek-V3's calls: ``function<｜tool▁sep｜>NAME``, then the arguments in a JSON code
    fence."""

    name: ClassVar[str] = "deepseekv3"
    separator: ClassVar[str] = "\n"

    def read_call(self, cursor: BlockCursor) -> ToolCall:
        cursor.literal(f"function{SEP}")
        name = _name(cursor, cursor.until("\n", forbidden=(SPECIAL,)))
        cursor.literal("```json")
        return ToolCall(name, _arguments(cursor, cursor.until(f"```{CALL_END}", MARKERS)))

    def call_tag(self, tool: FunctionTool) -> xst.TagFormat:
        return json_call_tag(f"{CALL_BEGIN}function{SEP}{tool.name}\n```json\n", tool,
                             f"\n```{CALL_END}")


class DeepSeekV31ToolCallParser(DeepSeekToolCallParser):
    """DeepSeek-V3.1's calls: ``NAME<｜tool▁sep｜>`` and the arguments' JSON."""

    name: ClassVar[str] = "deepseekv31"
    separator: ClassVar[str] = ""

    def read_call(self, cursor: BlockCursor) -> ToolCall:
        name = _name(cursor, cursor.until(SEP, forbidden=(SPECIAL, "\n")))
        return ToolCall(name, _arguments(cursor, cursor.until(CALL_END, MARKERS)))

    def call_tag(self, tool: FunctionTool) -> xst.TagFormat:
        return json_call_tag(f"{CALL_BEGIN}{tool.name}{SEP}", tool, CALL_END)


def _name(cursor: BlockCursor, name: str) -> str:
    cursor.fail_unless(name != "" and name == name.strip())
    return name


def _arguments(cursor: BlockCursor, text: str) -> str:
    """The arguments as written, if they are a JSON object."""
    text = text.strip()
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        value = None
    cursor.fail_unless(isinstance(value, dict))
    return text


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")
