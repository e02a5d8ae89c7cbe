"""The Llama 3.x JSON format (``tool_call_formats/llama3.py``; llama3): a corpus of
model-style outputs parsed, streamed over every split, and the structural tag checked with a
real xgrammar matcher. Ordinary JSON and semicolons in text stay content."""

from __future__ import annotations

import pytest
from structural_tag_checks import (
    TOOLS,
    accepts_prefix,
    assert_builtin_required_tag_lets_text_follow,
    assert_calls_alone,
    assert_named_tag_takes_that_function_only,
    assert_one_call_without_parallel,
    assert_required_tag_needs_a_tool,
    assert_round_trip,
    assert_tags_reject_schema_violations,
)
from token_checks import assert_tokens_take_calls_alone
from tool_call_checks import Corpus, assert_any_split_agrees, assert_parses_to, content_only

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


CORPUS: Corpus = [
    content_only(""),
    content_only("The weather in Paris is sunny."),
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
    content_only('The config is {"name": "server", "port": 8080}.'),
    content_only('{"a": 1} and {"b": [2]}'),
    content_only('{"parameters": {}, "name": "f"}'),
    content_only("function f() { return 1; }; g();"),
    content_only("first; second;third"),
    # Malformed calls are content.
    content_only('{"name": "f", "parameters": {"a": }}'),
    content_only('{"name": "f", "parameters": {"a": 1}'),
    content_only('{"name": "f", "parameters": "{\\"a\\": 1}"}'),
    content_only('{"name": "f", "parameters": {}, "arguments": {}}'),
    content_only('{"name": "f", "parameters": {}, "id": 1}'),
    content_only('{"name": "", "parameters": {}}'),
    content_only('{"name": "app", "version": "1.0", "parameters": {}}'),
    content_only('{"name": "a\\"b", "name": "f", "parameters": {}}'),
    content_only("{'name': 'f', 'parameters': {}}"),
    content_only('<|python_tag|>brave_search.call(query="weather")'),
    content_only('x; {"name": "f"}'),
    content_only("a partial tag <|python"),
    # A marker in prose, then a call; a call-shaped object inside other JSON is a call.
    ("Llama writes <|python_tag|> first. " + TIME, "Llama writes <|python_tag|> first. ",
     [TIME_CALL]),
    ('{"a": ' + TIME + "}", '{"a": }', [TIME_CALL]),
]


@pytest.mark.parametrize(("text", "content", "calls"), CORPUS)
def test_corpus_parses_and_streams_over_every_split(text, content, calls):
    assert_parses_to(PARSER, text, content, calls)


def test_any_cutting_of_the_corpus_streams_to_the_parse():
    assert_any_split_agrees(PARSER, CORPUS)


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
    assert_calls_alone(tag, PARIS, after=" Done.")


def test_xgrammars_own_required_tag_lets_text_follow_the_calls():
    """Why ``required`` is built here: xgrammar's builtin Llama tag takes text after."""
    assert_builtin_required_tag_lets_text_follow("llama", PARIS, " Done.")


def test_not_parallel_allows_one_call():
    assert_one_call_without_parallel(PARSER, PARIS, PARIS + ";" + TIME, TIME)


def test_named_function_tag_allows_that_function_only():
    assert_named_tag_takes_that_function_only(PARSER, TIME, TIME_CALL, '{"name": "get_weather"')


def test_tag_rejects_schema_violations():
    assert_tags_reject_schema_violations(PARSER, lambda arguments: obj("get_weather", arguments))


def test_required_tag_needs_a_tool():
    assert_required_tag_needs_a_tool(PARSER)


@pytest.mark.default_model
def test_tag_takes_the_calls_as_the_default_models_tokens():
    assert_tokens_take_calls_alone(PARSER, PARIS + ";" + TIME, PARIS)
