"""The parts of tool-call grammars that the formats share: a call as a tag around its JSON
arguments, the calls-only form of ``required`` (xgrammar's structural-tag formats), and
xgrammar's builtin tags for ``auto`` where a format writes calls as a builtin one does.

``calls_only`` is one or more calls with a separator between, and nothing else: no text
before or after (xgrammar's builtin ``required`` tags let text follow the calls), one call
only where calls are not ``parallel``.
"""

from __future__ import annotations

from typing import Any

import xgrammar as xgr
import xgrammar.structural_tag as st

from radixlm.runtime.output_parsing.tool_call_types import FunctionTool


def json_call_tag(begin: str, tool: FunctionTool, end: str) -> st.TagFormat:
    """``begin``, the tool's arguments as JSON valid against its schema, ``end``."""
    return st.TagFormat(begin=begin, content=st.JSONSchemaFormat(json_schema=tool.parameters),
                        end=end)


def json_call_tags(tools: list[FunctionTool], begin: str, arguments_begin: str,
                   end: str) -> list[st.TagFormat]:
    """Each tool's call as ``begin``, its name, ``arguments_begin``, its arguments as JSON,
    ``end``."""
    return [json_call_tag(begin + tool.name + arguments_begin, tool, end) for tool in tools]


def calls_only(tags: list[Any], separator: str, parallel: bool) -> st.TagsWithSeparatorFormat:
    """One or more of ``tags`` (one without ``parallel``), ``separator`` between; raises
    ``ValueError`` where there is no tool to call."""
    if not tags:
        raise ValueError("at least one tool call is required, but no tools are given")
    return st.TagsWithSeparatorFormat(tags=tags, separator=separator, at_least_one=True,
                                      stop_after_first=not parallel)


def openai_tools(tools: list[FunctionTool]) -> list[dict[str, Any]]:
    """``tools`` as xgrammar's builtin structural tags take them."""
    return [tool.openai_tool() for tool in tools]


def builtin_auto_tag(style: str, tools: list[FunctionTool], parallel: bool) -> dict[str, Any]:
    """xgrammar's builtin ``style`` tag under ``auto``: free text, calls wherever they begin."""
    return xgr.get_builtin_structural_tag(
        style, tools=openai_tools(tools), tool_choice="auto", reasoning=False,
        parallel_tool_calls=parallel).model_dump()
