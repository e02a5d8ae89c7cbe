"""The structural tag of pythonic tool calls (``pythonic.py``): a list of calls whose keyword
arguments are Python literals, constrained by each function's JSON schema.

xgrammar's JSON-schema formats write JSON, so the arguments are an EBNF grammar written here,
one rule per schema. What a schema may hold (anything else raises ``ValueError`` naming the
tool and the part, which the API answers with a 400):

- the parameters: an object of ``properties``, some ``required``; keywords come in the
  order the properties are declared, none but those; each name a Python identifier that is
  not a keyword (``class=`` would not parse);
- a value: ``type`` ``string``, ``integer``, ``number``, ``boolean`` or ``null`` (or a list
  of them), ``enum`` or ``const`` of such values, or an ``array`` of ``items`` that are any
  of these; annotations (``description``, ``title``, ``default``, ``examples``) are ignored.
  No ``pattern``, bounds, nested objects or ``$ref``.

Literals as the grammar writes them parse back to the JSON values the schema allows:
strings in single or double quotes, with JSON's escapes and ``\\'`` (never a lone
surrogate); ``True``/``False``/``None``; a ``number`` that is not an integer has at most 16
integer digits (as many as ``repr`` of a float writes) and a 2-digit exponent, so it is
never too large for a float.
"""

from __future__ import annotations

import json
import keyword
import math
import re
from typing import Any

from xgrammar import structural_tag as xst

from radixlm.runtime.output_parsing.tool_call_types import FunctionTool

ANNOTATIONS = frozenset({"description", "title", "default", "examples", "$comment"})
PARAMETER_KEYS = ANNOTATIONS | {"type", "properties", "required", "additionalProperties",
                                "$schema"}
RULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SCALAR_TYPES = ("string", "integer", "number", "boolean", "null")
SEPARATOR = '"," " "?'

BASE_RULES = {
    "hex": "[0-9a-fA-F]",
    # \\u escapes outside the surrogates, which JSON text cannot hold alone.
    "unicode_escape": '"\\\\u" ([0-9a-cA-CeEfF] hex hex hex | [dD] [0-7] hex hex)',
    "escape": "\"\\\\\" [\"'\\\\nrtbf] | unicode_escape",
    "string": "\"\\\"\" ([^\"\\\\\\r\\n] | escape)* \"\\\"\" "
              "| \"'\" ([^'\\\\\\r\\n] | escape)* \"'\"",
    "integer": '"-"? ("0" | [1-9] [0-9]*)',
    # Any integer; a float's integer part and exponent bounded so it stays finite.
    "number": 'integer | "-"? ("0" | [1-9] [0-9]{0,15}) ("." [0-9]+ exponent? | exponent)',
    "exponent": '[eE] [+-]? [0-9] [0-9]?',
    "boolean": '"True" | "False"',
    "null": '"None"',
}


def pythonic_structural_tag(tools: list[FunctionTool], at_least_one: bool,
                            parallel: bool) -> dict[str, Any]:
    """``[name(key=value, ...), ...]`` of ``tools`` (see ``ToolCallParser.structural_tag``):
    with ``at_least_one`` the output is one list alone; otherwise it is text, or text and one
    list (text after it only when ``parallel``), and text never writes ``[name(`` of a tool
    but to open that list. ``parallel`` false allows one call in the list.

    The grammar stays linear in the tools: the list's first call is dispatched on its
    ``[name(`` to that tool's rules alone, and the rest of the list, which may call any tool,
    is one grammar after it (a tag per tool holding the whole list would hold every tool's
    rules once per tool)."""
    if not tools:
        if at_least_one:
            raise ValueError("at least one tool call is required, but no tools are given")
        return xst.StructuralTag(format=xst.AnyTextFormat()).model_dump()
    rules = CallRules(tools)
    more = f"({SEPARATOR} call)*" if parallel else '""'
    if at_least_one:
        grammar = rules.ebnf(f'"[" call {more} "]"')
        return xst.StructuralTag(format=xst.GrammarFormat(grammar=grammar)).model_dump()
    openers = [f"[{tool.name}(" for tool in tools]
    text = xst.AnyTextFormat(excludes=openers)
    first_call = xst.TriggeredTagsFormat(
        triggers=openers,
        tags=[xst.TagFormat(begin=opener,
                            content=xst.GrammarFormat(grammar=rules.ebnf(rules.args[tool.name])),
                            end=")")
              for opener, tool in zip(openers, tools)],
        at_least_one=True, stop_after_first=True)
    rest = xst.GrammarFormat(grammar=rules.ebnf(f'{more} "]"'))
    with_list = xst.SequenceFormat(elements=[text, first_call, rest, *([text] if parallel else [])])
    return xst.StructuralTag(format=xst.OrFormat(elements=[text, with_list])).model_dump()


class CallRules:
    """The EBNF rules of a call of any of ``tools``: ``call``, and per tool the rule of its
    keyword arguments (``args``)."""

    def __init__(self, tools: list[FunctionTool]):
        self.rules: dict[str, str] = dict(BASE_RULES)
        self.args: dict[str, str] = {}
        for tool in tools:
            if not tool.name.isidentifier() or keyword.iskeyword(tool.name):
                raise ValueError(f"tool {tool.name!r}: a pythonic call's name must be a Python "
                                 "identifier")
            self.args[tool.name] = self._arguments(tool)
        self.rules["call"] = " | ".join(f'{_literal(name)} "(" {rule} ")"'
                                        for name, rule in self.args.items())

    def ebnf(self, root: str) -> str:
        """The grammar whose root is ``root``, with the rules it reaches (and perhaps a few
        more: a literal that spells a rule's name counts as a reference)."""
        reached, pending = {"root": root}, [root]
        while pending:
            for name in RULE_NAME.findall(pending.pop()):
                if name in self.rules and name not in reached:
                    reached[name] = self.rules[name]
                    pending.append(self.rules[name])
        return "".join(f"{name} ::= {body}\n" for name, body in reached.items())

    def _new_rule(self, body: str) -> str:
        name = f"r{len(self.rules)}"
        self.rules[name] = body
        return name

    def _arguments(self, tool: FunctionTool) -> str:
        """The rule of ``tool``'s keywords: the required ones and any of the others, in
        declared order, a separator between two."""
        schema = tool.parameters
        _check_keys(tool, "parameters", schema, PARAMETER_KEYS)
        if schema.get("type", "object") != "object":
            raise ValueError(f"tool {tool.name!r}: parameters must be an object schema")
        properties = schema.get("properties", {})
        required = set(schema.get("required", []))
        if not required <= set(properties):
            raise ValueError(f"tool {tool.name!r}: required parameters "
                             f"{sorted(required - set(properties))} have no properties")
        keywords = []
        for name, value_schema in properties.items():
            if not name.isidentifier() or keyword.iskeyword(name):
                raise ValueError(f"tool {tool.name!r}: parameter {name!r} is not a Python "
                                 "identifier, so a pythonic call cannot pass it")
            value = self._value(tool, f"parameter {name!r}", value_schema)
            keywords.append((f'"{name}=" {value}', name in required))
        # first_i: keywords i.. with none written yet; more_i: the same, each after a separator.
        first, more = '""', '""'
        for written, is_required in reversed(keywords):
            next_first, next_more = first, more
            first = self._new_rule(f"{written} {next_more}"
                                   + ("" if is_required else f" | {next_first}"))
            more = self._new_rule(f"{SEPARATOR} {written} {next_more}"
                                  + ("" if is_required else f" | {next_more}"))
        return first

    def _value(self, tool: FunctionTool, where: str, schema: Any) -> str:
        """The rule of a value of ``schema`` (see module docstring)."""
        if not isinstance(schema, dict):
            raise ValueError(f"tool {tool.name!r}: {where}: a schema must be an object")
        types = schema.get("type", [])
        kinds = types if isinstance(types, list) else [types]
        unsupported = [kind for kind in kinds if kind not in SCALAR_TYPES and kind != "array"]
        if unsupported:
            raise ValueError(f"tool {tool.name!r}: {where}: type {unsupported[0]!r} is not "
                             "supported in pythonic calls")
        if "enum" in schema or "const" in schema:
            _check_keys(tool, where, schema, ANNOTATIONS | {"type", "enum", "const"})
            values = schema["enum"] if "enum" in schema else [schema["const"]]
            return self._new_rule(" | ".join(_literal(literal) for value in values
                                             for literal in _python_literals(tool, where, value)))
        _check_keys(tool, where, schema,
                    ANNOTATIONS | {"type"} | ({"items"} if "array" in kinds else set()))
        if not kinds:
            raise ValueError(f"tool {tool.name!r}: {where}: a schema without a type is not "
                             "supported in pythonic calls")
        alternatives = []
        for kind in kinds:
            if kind == "array":
                if "items" not in schema:
                    raise ValueError(f"tool {tool.name!r}: {where}: an array needs 'items'")
                item = self._value(tool, f"{where} items", schema["items"])
                alternatives.append(f'"[" ({item} ({SEPARATOR} {item})*)? "]"')
            else:
                alternatives.append(kind)
        return self._new_rule(" | ".join(alternatives))


def _check_keys(tool: FunctionTool, where: str, schema: dict, allowed: frozenset[str]) -> None:
    unsupported = sorted(set(schema) - allowed)
    if unsupported:
        raise ValueError(f"tool {tool.name!r}: {where}: {', '.join(map(repr, unsupported))} "
                         "not supported in pythonic calls")


def _python_literals(tool: FunctionTool, where: str, value: Any) -> list[str]:
    """The Python literals whose ``ast.literal_eval`` is ``value`` that the grammar allows:
    a string in either quotes, JSON's escapes (which mean the same in Python)."""
    if value is None or isinstance(value, bool):
        return [repr(value)]
    if isinstance(value, int) or (isinstance(value, float) and math.isfinite(value)):
        return [repr(value)]
    if isinstance(value, str):
        double = json.dumps(value, ensure_ascii=False)
        single = "'" + double[1:-1].replace('\\"', '"').replace("'", "\\'") + "'"
        return [double, single]
    raise ValueError(f"tool {tool.name!r}: {where}: enum value {value!r} is not supported "
                     "in pythonic calls")


def _literal(text: str) -> str:
    """``text`` as an EBNF string literal."""
    return json.dumps(text, ensure_ascii=False)
