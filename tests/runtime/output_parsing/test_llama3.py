"""The Llama 3.x JSON format (``tool_call_formats/llama3.py``; llama3): a corpus of
model-style outputs parsed, streamed over every split, and the structural tag checked with a
real xgrammar matcher. Ordinary JSON and semicolons in text stay content."""

from __future__ import annotations

import pytest
import xgrammar as xgr
from structural_tag_checks import TIME as TIME_TOOL
from structural_tag_checks import TOOLS, WEATHER, accepts, accepts_prefix, assert_round_trip
from token_checks import accepts_tokens
from tool_call_checks import assert_any_split_agrees, assert_stream_agrees

from radixlm.runtime.output_parsing.tool_call_formats.hermes import openai_tools
from radixlm.runtime.output_parsing.tool_call_formats.llama3 import Llama3ToolCallParser
from radixlm.runtime.output_parsing.tool_call_types import ToolCall

PARSER = Llama3ToolCallParser()


def obj(name: str, arguments: str, key: str = "parameters") -> str:
    """A call as Llama 3's JSON tool-calling prompt asks for it."""
    return f'{{"name": "{name}", "{key}": {arguments}}}'


PARIS_ARGS = '{"city": "Paris", "days": 3}'
PARIS = obj("get_weather", PARIS_ARGS)
PARIS_CALL = ToolCall("get_weather", PARIS_ARGS)
TIME = obj("get_time", "{}")
TIME_CALL = ToolCall("get_time", "{}")
NESTED = '{"filter": {"and": [{"x": 1}, {"y": [true, null, -1.5e-3]}]}}'
UNICODE = '{"city": "Zürich 東京 🌧", "note": "\\u00e9"}'
ESCAPED = '{"code": "if (a) { b(); }; c; \\"q\\"\\\\"}'


def same(text: str) -> tuple[str, str, list[ToolCall]]:
    """An output with no call: all of it is content."""
    return text, text, []


CORPUS: list[tuple[str, str, list[ToolCall]]] = [
    same(""),
    same("The weather in Paris is sunny."),
    (PARIS, "", [PARIS_CALL]),
    (obj("get_weather", PARIS_ARGS, "arguments"), "", [PARIS_CALL]),
    ("<|python_tag|>" + PARIS, "", [PARIS_CALL]),
    ("<|python_tag|> \n" + TIME, "", [TIME_CALL]),
    (PARIS + "; " + TIME, "", [PARIS_CALL, TIME_CALL]),
    (TIME + ";" + PARIS + " ;\n" + TIME, " ", [TIME_CALL, PARIS_CALL, TIME_CALL]),
    (PARIS + "\n" + TIME, "\n", [PARIS_CALL, TIME_CALL]),
    ("Let me check. " + PARIS, "Let me check. ", [PARIS_CALL]),
    (PARIS + " That is the call.", " That is the call.", [PARIS_CALL]),
    (obj("search", NESTED), "", [ToolCall("search", NESTED)]),
    (obj("get_weather", UNICODE), "", [ToolCall("get_weather", UNICODE)]),
    (obj("run", ESCAPED), "", [ToolCall("run", ESCAPED)]),
    ('{ "name" : "f" ,"parameters":{"b":1,  "a" : [ 1,2 ]} }', "",
     [ToolCall("f", '{"b":1,  "a" : [ 1,2 ]}')]),
    # Ordinary JSON and braces in text are content.
    same('The config is {"name": "server", "port": 8080}.'),
    same('{"a": 1} and {"b": [2]}'),
    same('{"parameters": {}, "name": "f"}'),
    same("function f() { return 1; }; g();"),
    same("first; second;third"),
    # Malformed calls are content.
    same('{"name": "f", "parameters": {"a": }}'),
    same('{"name": "f", "parameters": {"a": 1}'),
    same('{"name": "f", "parameters": "{\\"a\\": 1}"}'),
    same('{"name": "f", "parameters": {}, "arguments": {}}'),
    same('{"name": "f", "parameters": {}, "id": 1}'),
    same('{"name": "", "parameters": {}}'),
    same('{"name": "app", "version": "1.0", "parameters": {}}'),
    same('{"name": "a\\"b", "name": "f", "parameters": {}}'),
    same("{'name': 'f', 'parameters': {}}"),
    same('<|python_tag|>brave_search.call(query="weather")'),
    same('x; {"name": "f"}'),
    same("a partial tag <|python"),
    # A marker in prose, then a call; a call-shaped object inside other JSON is a call.
    ("Llama writes <|python_tag|> first. " + TIME, "Llama writes <|python_tag|> first. ",
     [TIME_CALL]),
    ('{"a": ' + TIME + "}", '{"a": }', [TIME_CALL]),
]


@pytest.mark.parametrize(("text", "content", "calls"), CORPUS)
def test_corpus_parses_and_streams_over_every_split(text, content, calls):
    parsed = assert_stream_agrees(PARSER, text)
    assert parsed.content == content
    assert parsed.calls == calls


def test_any_cutting_of_the_corpus_streams_to_the_parse():
    assert_any_split_agrees(PARSER, [text for text, _, _ in CORPUS])


def test_braces_that_open_no_call_are_given_as_soon_as_their_first_key_says_so():
    stream = PARSER.stream()
    assert stream.feed('config {"port"') == ['config {"port"']
    assert stream.feed(': 1} {"na') == [': 1} ']
    assert stream.feed('me": "f", "parameters": {}}') == [ToolCall("f", "{}")]
    assert stream.feed('{"name": "my-app", "vers') == ['{"name": "my-app", "vers']
    assert stream.finish() == []


def test_auto_tag_allows_text_and_calls():
    tag = PARSER.structural_tag(TOOLS, at_least_one=False, parallel=True)
    assert_round_trip(PARSER, tag, "Sure.", [], "Sure.")
    assert_round_trip(PARSER, tag, 'Config: {"port": 1}', [], 'Config: {"port": 1}')
    assert_round_trip(PARSER, tag, "Checking. " + PARIS + "; " + TIME,
                      [PARIS_CALL, TIME_CALL], "Checking. ")
    assert not accepts_prefix(tag, 'Ok {"name": "bob"')  # a call's start must be a call


def test_required_tag_allows_calls_only():
    tag = PARSER.structural_tag(TOOLS, at_least_one=True, parallel=True)
    assert_round_trip(PARSER, tag, PARIS + ";" + TIME, [PARIS_CALL, TIME_CALL])
    assert not accepts(tag, "")
    assert not accepts_prefix(tag, "Sure")
    assert not accepts(tag, "Sure. " + PARIS)
    assert not accepts(tag, PARIS + " Done.")


def test_xgrammars_own_required_tag_lets_text_follow_the_calls():
    """Why ``required`` is built here: xgrammar's builtin Llama tag takes text after."""
    builtin = xgr.get_builtin_structural_tag("llama", tools=openai_tools(TOOLS),
                                             tool_choice="required", reasoning=False)
    assert accepts(builtin.model_dump(), PARIS + " Done.")
    assert not accepts(builtin.model_dump(), "Sure. " + PARIS)


def test_not_parallel_allows_one_call():
    for at_least_one in (False, True):
        tag = PARSER.structural_tag(TOOLS, at_least_one=at_least_one, parallel=False)
        assert accepts(tag, PARIS)
        assert not accepts(tag, PARIS + ";" + TIME)
    assert accepts(PARSER.structural_tag(TOOLS, False, False), "Text first. " + TIME)


def test_named_function_tag_allows_that_function_only():
    tag = PARSER.structural_tag([TIME_TOOL], at_least_one=True, parallel=False)
    assert_round_trip(PARSER, tag, TIME, [TIME_CALL])
    assert not accepts_prefix(tag, '{"name": "get_weather"')


def test_tag_rejects_schema_violations():
    for at_least_one in (False, True):
        tag = PARSER.structural_tag([WEATHER], at_least_one=at_least_one, parallel=True)
        assert not accepts(tag, obj("get_weather", '{"days": 3}'))  # city is required
        assert not accepts_prefix(tag, obj("get_weather", '{"city": "P", "days": "three"}'))
        assert not accepts_prefix(tag, obj("get_weather", '{"city": "P", "unit": "kelvin"}'))
        oslo = '{"city": "Oslo", "unit": "celsius"}'
        assert_round_trip(PARSER, tag, obj("get_weather", oslo), [ToolCall("get_weather", oslo)])


def test_required_tag_needs_a_tool():
    with pytest.raises(ValueError, match="no tools"):
        PARSER.structural_tag([], at_least_one=True, parallel=True)
    assert accepts(PARSER.structural_tag([], at_least_one=False, parallel=True), "any text")


@pytest.mark.default_model
def test_tag_takes_the_calls_as_the_default_models_tokens():
    tag = PARSER.structural_tag(TOOLS, at_least_one=True, parallel=True)
    assert accepts_tokens(tag, PARIS + ";" + TIME)
    assert not accepts_tokens(tag, "Sure. " + PARIS)
