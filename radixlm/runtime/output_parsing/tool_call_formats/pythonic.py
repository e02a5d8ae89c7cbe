"""Pythonic tool calls (``--tool-call-parser pythonic``; Llama 3.2 and Llama 4): a Python
list of calls with keyword arguments that are Python literals::

    [get_weather(city="Paris", days=3), get_time(zone='UTC', exact=True)]

A block opens at any ``[`` and is read as far as a prefix decides it: a name, ``(``, the
arguments to the matching ``)`` (brackets and quoted strings tracked), then ``,`` and the next
call or the closing ``]``. Something else in those places makes the ``[`` content at once, so
``[1, 2]`` or ``[see above]`` in prose stays content. The list found is then parsed with
``ast.parse`` (never evaluated): it must be calls by plain names, each with keyword arguments
only, none repeated, each value a literal (``ast.literal_eval``) that JSON can hold: numbers,
strings, ``True``/``False``/``None`` (JSON's ``true``/``false``/``null``), lists and tuples
(arrays), dicts with string keys. Otherwise the whole list is content. ``arguments`` is
``json.dumps`` of the keywords, in the order written.

Llama 4 may wrap the list in ``<|python_start|>``/``<|python_end|>``; those tokens are not
read here, and stay content when the detokenizer keeps special tokens.
"""

from __future__ import annotations

import ast
import re
import warnings
from typing import Any, ClassVar

from radixlm.runtime.output_parsing.block_parser import (
    INCOMPLETE,
    INVALID,
    Block,
    BlockToolCallParser,
    Undecided,
)
from radixlm.runtime.output_parsing.tool_call_formats.block_reading import (
    json_object_text,
    skip_space,
)
from radixlm.runtime.output_parsing.tool_call_formats.pythonic_grammar import (
    pythonic_structural_tag,
)
from radixlm.runtime.output_parsing.tool_call_types import FunctionTool, ToolCall

NAME = re.compile(r"[^\W\d]\w*")
CLOSING = {"(": ")", "[": "]", "{": "}"}


class PythonicToolCallParser(BlockToolCallParser):
    """Lists of Python calls (see module docstring)."""

    name: ClassVar[str] = "pythonic"

    def find_block(self, text: str, start: int) -> tuple[int | None, int]:
        found = text.find("[", start)
        return (found, 0) if found >= 0 else (None, 0)

    def match_block(self, text: str, start: int) -> Block | Undecided:
        end = _list_end(text, start)
        if isinstance(end, Undecided):
            return end
        calls = _calls(text[start:end])
        return INVALID if calls is None else Block(calls, end)

    def structural_tag(self, tools: list[FunctionTool], at_least_one: bool,
                       parallel: bool) -> dict[str, Any]:
        """See ``pythonic_grammar.py``: raises ``ValueError`` for a schema it cannot
        write as Python literals."""
        return pythonic_structural_tag(tools, at_least_one, parallel)


def _list_end(text: str, start: int) -> int | Undecided:
    """The index just past the ``]`` that closes a list of calls opening at ``start``, read
    left to right so that a definite answer holds for every longer text."""
    pos = start + 1
    while True:
        pos = skip_space(text, pos)
        name = NAME.match(text, pos)
        if name is None:
            return INCOMPLETE if pos == len(text) else INVALID
        pos = name.end()
        if pos == len(text):
            return INCOMPLETE
        if text[pos] != "(":
            return INVALID
        end = _group_end(text, pos)
        if isinstance(end, Undecided):
            return end
        pos = skip_space(text, end)
        if pos == len(text):
            return INCOMPLETE
        if text[pos] == "]":
            return pos + 1
        if text[pos] != ",":
            return INVALID
        pos = skip_space(text, pos + 1)
        if text.startswith("]", pos):  # a trailing comma, as Python allows
            return pos + 1


def _group_end(text: str, pos: int) -> int | Undecided:
    """The index just past the bracket that closes the one at ``pos``, strings skipped."""
    expected: list[str] = []
    while pos < len(text):
        char = text[pos]
        if char in CLOSING:
            expected.append(CLOSING[char])
        elif char in ")]}":
            if char != expected.pop():
                return INVALID
            if not expected:
                return pos + 1
        elif char in "\"'":
            end = _string_end(text, pos)
            if isinstance(end, Undecided):
                return end
            pos = end
            continue
        pos += 1
    return INCOMPLETE


def _string_end(text: str, pos: int) -> int | Undecided:
    """The index just past the quoted string opening at ``pos`` (triple quotes included)."""
    quote = text[pos]
    if set(text[pos:pos + 3]) == {quote} and len(text) - pos < 3:
        return INCOMPLETE  # an empty string or a triple quote: the next character decides
    delimiter = quote * 3 if text.startswith(quote * 3, pos) else quote
    pos += len(delimiter)
    while pos < len(text):
        if text[pos] == "\\":
            pos += 2
        elif text.startswith(delimiter, pos):
            return pos + len(delimiter)
        elif text[pos] == "\n" and len(delimiter) == 1:
            return INVALID  # a one-line string does not span lines
        else:
            pos += 1
    return INCOMPLETE


def _calls(source: str) -> list[ToolCall] | None:
    """The calls of a list's text, or None if it is not a list of literal calls."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an unknown escape such as "\d" is kept as written
            tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List):
        return None
    calls = []
    for node in tree.body.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
            return None
        arguments: dict[str, Any] = {}
        for keyword in node.keywords:
            if keyword.arg is None or keyword.arg in arguments:
                return None
            try:
                arguments[keyword.arg] = _json_value(ast.literal_eval(keyword.value))
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return None
        text = json_object_text(arguments)
        if text is None:
            return None
        calls.append(ToolCall(node.func.id, text))
    return calls


def _json_value(value: Any) -> Any:
    """A literal's value as JSON holds it; ``ValueError`` for one it cannot (bytes, sets,
    complex numbers, dicts with keys that are not strings)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_json_value(item) for item in value]
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {key: _json_value(item) for key, item in value.items()}
    raise ValueError(f"{type(value).__name__} has no JSON form")
