"""The tool-call parsers ``--tool-call-parser NAME`` knows (SGLang's names, and vLLM's
``hermes``), and the guess of a model's parser from its chat template.

A parser's module is imported only when the parser is asked for, so a server that parses no
tool calls imports no format (nor xgrammar through one). ``detect_tool_call_parser`` reads
markers a family's chat template writes when it renders calls; it returns None rather than a
guess when it finds none, and a server then parses no tool calls unless told.
"""

from __future__ import annotations

import importlib

from radixlm.runtime.output_parsing.tool_call_types import ToolCallParser

_FORMATS = "radixlm.runtime.output_parsing.tool_call_formats"

TOOL_CALL_PARSERS: dict[str, str] = {
    "qwen25": f"{_FORMATS}.hermes:HermesToolCallParser",
    "qwen": f"{_FORMATS}.hermes:HermesToolCallParser",
    "hermes": f"{_FORMATS}.hermes:HermesToolCallParser",
    "llama3": f"{_FORMATS}.llama3:Llama3ToolCallParser",
    "mistral": f"{_FORMATS}.mistral:MistralToolCallParser",
    "qwen3_coder": f"{_FORMATS}.qwen3_coder:Qwen3CoderToolCallParser",
    "deepseekv3": f"{_FORMATS}.deepseek:DeepSeekV3ToolCallParser",
    "deepseekv31": f"{_FORMATS}.deepseek:DeepSeekV31ToolCallParser",
    "pythonic": f"{_FORMATS}.pythonic:PythonicToolCallParser",
}
"""Parser name -> ``"module:Class"`` of its ``ToolCallParser``."""

# Markers of the chat templates, as the families' templates write them.
QWEN3_CODER_MARKERS = ("<function=", "<parameter=")
DEEPSEEK_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
DEEPSEEK_V3_FENCE = "```json"  # V3 writes arguments in a fenced block; V3.1 writes them bare
MISTRAL_MARKER = "[TOOL_CALLS]"
LLAMA3_PYTHON_TAG = "<|python_tag|>"
LLAMA3_HEADER = "<|start_header_id|>"
LLAMA3_TOOL_ROLE = "ipython"
HERMES_MARKER = "<tool_call>"


def get_tool_call_parser(name: str) -> ToolCallParser:
    """A fresh parser for ``--tool-call-parser NAME``; ``ValueError`` naming the known ones
    if ``name`` is not one of them."""
    target = TOOL_CALL_PARSERS.get(name)
    if target is None:
        raise ValueError(f"--tool-call-parser {name!r} is unknown; known: "
                         f"{', '.join(sorted(TOOL_CALL_PARSERS))}")
    module_name, class_name = target.split(":")
    parser_class = getattr(importlib.import_module(module_name), class_name)
    return parser_class()


def detect_tool_call_parser(chat_template: str | None) -> str | None:
    """The parser name for the family whose markers ``chat_template`` writes, or None.

    Families are tried from the most specific markers to the least: a Qwen3-Coder template
    also writes ``<tool_call>`` (around its XML calls), so Hermes comes last."""
    if not chat_template:
        return None
    if all(marker in chat_template for marker in QWEN3_CODER_MARKERS):
        return "qwen3_coder"
    if DEEPSEEK_CALLS_BEGIN in chat_template:
        return "deepseekv3" if DEEPSEEK_V3_FENCE in chat_template else "deepseekv31"
    if MISTRAL_MARKER in chat_template:
        return "mistral"
    if LLAMA3_PYTHON_TAG in chat_template or (
            LLAMA3_HEADER in chat_template and LLAMA3_TOOL_ROLE in chat_template):
        return "llama3"
    if HERMES_MARKER in chat_template:
        return "qwen25"
    return None
