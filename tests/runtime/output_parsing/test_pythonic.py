"""Pythonic tool calls (``tool_call_formats/pythonic.py`` and ``pythonic_grammar.py``): a
corpus of model-style outputs parsed and streamed over every split; the structural tag's
Python-literal grammar checked with xgrammar, and what it accepts parsed back."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from structural_tag_checks import (
    TOOLS,
    WEATHER,
    accepts,
    accepts_prefix,
    assert_calls_alone,
    assert_default_model_opens_only_calls,
    assert_named_tag_takes_that_function_only,
    assert_round_trip,
)
from tool_call_checks import Corpus, assert_any_split_agrees, assert_parses_to

from radixlm.runtime.output_parsing.block_parser import INCOMPLETE, INVALID
from radixlm.runtime.output_parsing.tool_call_formats.pythonic import PythonicToolCallParser
from radixlm.runtime.output_parsing.tool_call_types import FunctionTool, ToolCall

PARSER = PythonicToolCallParser()


def tc(name: str, **arguments) -> ToolCall:
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


PARIS = '[get_weather(city="Paris", days=3)]'
PARIS_CALL = tc("get_weather", city="Paris", days=3)

CORPUS: Corpus = [
    ("", "", []),
    ("It is sunny in Paris.", "It is sunny in Paris.", []),
    (PARIS, "", [PARIS_CALL]),
    ('[get_weather(city="Paris", days=3), other(x=[1, 2])]', "",
     [PARIS_CALL, tc("other", x=[1, 2])]),
    ("[get_time()]", "", [tc("get_time")]),
    ("Let me look that up. " + PARIS, "Let me look that up. ", [PARIS_CALL]),
    (PARIS + "\nOne moment.", "\nOne moment.", [PARIS_CALL]),
    ("[f(a=True, b=False, c=None)]", "", [tc("f", a=True, b=False, c=None)]),
    ("[f(n=-1.5e3, big=12345678901234567890, t=(1, 'x'))]", "",
     [tc("f", n=-1500.0, big=12345678901234567890, t=[1, "x"])]),
    ("[f(d={'k': [1, {'j': None}]}, s='it\\'s')]", "",
     [tc("f", d={"k": [1, {"j": None}]}, s="it's")]),
    ('[f(s="Zürich 東京 🌧 \\u00e9\\n", b="a]b)c(d[")]', "",
     [tc("f", s="Zürich 東京 🌧 é\n", b="a]b)c(d[")]),
    ('[\n  f(a=1),\n  g(b="""multi\nline"""),\n]', "", [tc("f", a=1), tc("g", b="multi\nline")]),
    # Lists that are not calls stay content.
    ("See [1, 2] and [note] or [link](http://x).", "See [1, 2] and [note] or [link](http://x).",
     []),
    ("[f(1, a=2)]", "[f(1, a=2)]", []),
    ("[f(a=1, a=2)]", "[f(a=1, a=2)]", []),
    ("[f(a=x)]", "[f(a=x)]", []),
    ("[f(a=1+2)]", "[f(a=1+2)]", []),
    ("[f(a=b'x'), g(c={1, 2})]", "[f(a=b'x'), g(c={1, 2})]", []),
    ("[f(a=1e999)]", "[f(a=1e999)]", []),
    ("[os.system(cmd='ls')]", "[os.system(cmd='ls')]", []),
    ("[f(**kw)]", "[f(**kw)]", []),
    ("[f(a=1) g(b=2)]", "[f(a=1) g(b=2)]", []),
    ("[f(a=1]", "[f(a=1]", []),
    ('[f(a="unclosed)]', '[f(a="unclosed)]', []),
    ("[f(a=1)", "[f(a=1)", []),
    ("arr[idx] = [get_time()]", "arr[idx] = ", [tc("get_time")]),
    ("[[f(a=1)]]", "[]", [tc("f", a=1)]),
]


@pytest.mark.parametrize(("text", "content", "calls"), CORPUS)
def test_corpus_parses_and_streams_over_every_split(text, content, calls):
    assert_parses_to(PARSER, text, content, calls)


def test_any_cutting_of_the_corpus_streams_to_the_parse():
    assert_any_split_agrees(PARSER, CORPUS)


def test_a_list_is_decided_as_soon_as_a_prefix_can():
    assert PARSER.match_block("[1", 0) is INVALID
    assert PARSER.match_block("[get_weather", 0) is INCOMPLETE
    assert PARSER.match_block("[get_weather ", 0) is INVALID
    assert PARSER.match_block('[f(a="x\n', 0) is INVALID
    assert PARSER.match_block('[f(a="', 0) is INCOMPLETE
    assert PARSER.match_block("[f(a=1), ", 0) is INCOMPLETE


RICH = FunctionTool("tune", {
    "type": "object",
    "properties": {"flags": {"type": "array", "items": {"type": "boolean"}},
                   "ratio": {"type": "number", "description": "a share"},
                   "note": {"type": ["string", "null"]},
                   "level": {"enum": [1, 2.5, "max", None, True]}},
    "required": ["ratio"],
})


def test_auto_tag_allows_text_and_calls():
    tag = PARSER.structural_tag(TOOLS, at_least_one=False, parallel=True)
    assert_round_trip(PARSER, tag, "Prose with [brackets].", [], "Prose with [brackets].")
    assert_round_trip(PARSER, tag, 'Sure. [get_weather(city="Os)lo", days=2), get_time()] ok',
                      [tc("get_weather", city="Os)lo", days=2), tc("get_time")], "Sure.  ok")
    assert_round_trip(PARSER, tag, "[get_time] is [1, 2]", [], "[get_time] is [1, 2]")
    assert not accepts(tag, "[get_time()] and again [get_time()]")
    assert not accepts_prefix(tag, "Sure. [get_time(), get_date(")


def test_tags_stay_small_with_many_tools():
    properties = {f"p{i}": {"type": ["string", "null"]} for i in range(5)}
    tools = [FunctionTool(f"tool{j}", {"type": "object", "properties": properties})
             for j in range(32)]
    for at_least_one in (False, True):
        tag = PARSER.structural_tag(tools, at_least_one=at_least_one, parallel=True)
        assert accepts(tag, "[tool31(p0='x'), tool0(p4=None)]")  # the server compiles it


def test_required_tag_allows_one_list_alone():
    tag = PARSER.structural_tag(TOOLS, at_least_one=True, parallel=True)
    assert_round_trip(PARSER, tag, "[get_time(), get_weather(city='Oslo', unit=\"celsius\")]",
                      [tc("get_time"), tc("get_weather", city="Oslo", unit="celsius")])
    assert not accepts(tag, "[]")
    assert_calls_alone(tag, "[get_time()]", before="Sure ", after=" done")


def test_not_parallel_allows_one_call():
    for at_least_one in (False, True):
        tag = PARSER.structural_tag(TOOLS, at_least_one=at_least_one, parallel=False)
        assert accepts(tag, "[get_time()]")
        assert not accepts_prefix(tag, "[get_time(), get_time()]")
    tag = PARSER.structural_tag(TOOLS, at_least_one=False, parallel=False)
    assert not accepts(tag, "[get_time()] and [get_time()]")


def test_named_function_tag_allows_that_function_only():
    assert_named_tag_takes_that_function_only(PARSER, "[get_time()]", tc("get_time"),
                                              "[get_weather(")


def test_tag_rejects_schema_violations():
    tag = PARSER.structural_tag([WEATHER, RICH], at_least_one=True, parallel=True)
    for text in ["[get_weather(days=3)]", "[get_weather(city='Oslo', days='3')]",
                 "[get_weather(city='Oslo', unit='kelvin')]", "[get_weather(town='Oslo')]",
                 "[get_weather(days=3, city='Oslo')]", "[tune(ratio=1, flags=[1])]",
                 "[tune(ratio=true)]", "[tune(ratio=1, level=3)]", "[get_weather(city=x)]",
                 "[get_weather(city='a\\x00')]", "[get_weather(city='\\ud800')]"]:
        assert not accepts(tag, text), text
    assert_round_trip(PARSER, tag,
                      "[tune(flags=[True, False], ratio=-0.5e-3, note=None, level='max'), "
                      "tune(ratio=7, note='x', level=None)]",
                      [tc("tune", flags=[True, False], ratio=-0.0005, note=None, level="max"),
                       tc("tune", ratio=7, note="x", level=None)])


def python_literal(value) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(map(python_literal, value)) + "]"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    return repr(value)


SMALL_FLOATS = st.floats(-1e50, 1e50).filter(lambda x: x == 0 or abs(x) > 1e-50)


@settings(max_examples=150, deadline=None)
@given(flags=st.none() | st.lists(st.booleans(), max_size=3), ratio=st.integers() | SMALL_FLOATS,
       note=st.none() | st.text(max_size=8),
       level=st.sampled_from([1, 2.5, "max", None, True]))
def test_literals_the_grammar_writes_parse_back(flags, ratio, note, level):
    arguments = {"flags": flags, "ratio": ratio, "note": note, "level": level}
    written = {key: value for key, value in arguments.items()
               if not (key == "flags" and value is None)}  # flags left out, as it may be
    source = "[tune(" + ", ".join(f"{k}={python_literal(v)}" for k, v in written.items()) + ")]"
    tag = PARSER.structural_tag([RICH], at_least_one=True, parallel=False)
    assert_round_trip(PARSER, tag, source, [tc("tune", **written)])


@pytest.mark.parametrize(("schema", "part"), [
    ({"type": "object", "properties": {"x": {"type": "string", "pattern": "a+"}}}, "'pattern'"),
    ({"type": "object", "properties": {"x": {"type": "object", "properties": {}}}}, "'object'"),
    ({"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}}, "'\\$ref'"),
    ({"type": "object", "properties": {"x": {"type": "integer", "minimum": 0}}}, "'minimum'"),
    ({"type": "object", "properties": {"x": {"type": "array"}}}, "'items'"),
    ({"type": "object", "properties": {"x": {}}}, "without a type"),
    ({"type": "object", "properties": {"class": {"type": "string"}}}, "'class'"),
    ({"type": "object", "properties": {"x": {"enum": [[1]]}}}, "enum value"),
    ({"type": "object", "anyOf": []}, "'anyOf'"),
    ({"type": "array"}, "object schema"),
    ({"type": "object", "properties": {}, "required": ["y"]}, "'y'"),
])
def test_unsupported_schemas_raise_naming_the_tool_and_part(schema, part):
    with pytest.raises(ValueError, match=f"tool 'odd'.*{part}"):
        PARSER.structural_tag([FunctionTool("odd", schema)], at_least_one=False, parallel=True)


def test_names_that_are_not_identifiers_raise():
    with pytest.raises(ValueError, match="'get-weather'"):
        PARSER.structural_tag([FunctionTool("get-weather")], at_least_one=True, parallel=True)
    with pytest.raises(ValueError, match="no tools"):
        PARSER.structural_tag([], at_least_one=True, parallel=True)


@pytest.mark.default_model
def test_default_model_may_only_open_a_call_under_the_required_tag():
    assert_default_model_opens_only_calls(PARSER, "[get_")
