"""The Hermes format (``tool_call_formats/hermes.py``; qwen25, qwen, hermes): a corpus of
model-style outputs parsed, streamed over every split, and the structural tag checked with
a real xgrammar matcher."""

from __future__ import annotations

import pytest
from structural_tag_checks import (
    TOOLS,
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

from radixlm.runtime.output_parsing.tool_call_formats.hermes import HermesToolCallParser
from radixlm.runtime.output_parsing.tool_call_types import ToolCall

PARSER = HermesToolCallParser()


def block(name: str, arguments: str) -> str:
    """A call as Qwen's chat template writes it (``arguments`` is the JSON text)."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


PARIS_ARGS = '{"city": "Paris", "days": 3}'
PARIS = block("get_weather", PARIS_ARGS)
PARIS_CALL = ToolCall("get_weather", PARIS_ARGS)
TIME_BLOCK = block("get_time", "{}")
TIME_CALL = ToolCall("get_time", "{}")
NESTED = '{"filter": {"and": [{"x": 1}, {"y": [true, null, -1.5e-3]}]}, "tags": []}'
UNICODE = '{"city": "Zürich 東京 🌧", "note": "\\u00e9\\ud83c\\udf27"}'
ESCAPED = '{"q": "say \\"hi\\"\\n</tool_call> {\\"x\\": 1}\\\\"}'
UNCLOSED = '<tool_call>\n{"name": "get_time", "arguments": {}}\n'


CORPUS: Corpus = [
    ("", "", []),
    ("The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    (PARIS, "", [PARIS_CALL]),
    ("Let me check.\n" + PARIS, "Let me check.\n", [PARIS_CALL]),
    (PARIS + "\nI asked for the weather.", "\nI asked for the weather.", [PARIS_CALL]),
    (PARIS + "\n" + TIME_BLOCK, "\n", [PARIS_CALL, TIME_CALL]),
    ("a" + TIME_BLOCK + "b" + PARIS + "c" + TIME_BLOCK + "d", "abcd",
     [TIME_CALL, PARIS_CALL, TIME_CALL]),
    (block("search", NESTED), "", [ToolCall("search", NESTED)]),
    (block("get_weather", UNICODE), "", [ToolCall("get_weather", UNICODE)]),
    # A closing marker inside a JSON string does not close the block.
    (block("ask", ESCAPED), "", [ToolCall("ask", ESCAPED)]),
    # Whitespace around the JSON is free; the arguments keep the model's own text.
    ('<tool_call>{"name":"f","arguments":{"b":1,  "a" : [ 1,2 ]}}</tool_call>', "",
     [ToolCall("f", '{"b":1,  "a" : [ 1,2 ]}')]),
    ('<tool_call>\n\n  {"name": "f", "arguments": {}} \t\n\n</tool_call>', "",
     [ToolCall("f", "{}")]),
    ('<tool_call>\n{"arguments": {"a": 1}, "name": "f"}\n</tool_call>', "",
     [ToolCall("f", '{"a": 1}')]),
    # Malformed: content, byte for byte.
    content_only('<tool_call>\n{"name": "f", "arguments": {"a": }}\n</tool_call>'),
    content_only('<tool_call>\n{"name": "f", "arguments": {"x": NaN}}\n</tool_call>'),
    content_only(UNCLOSED),
    content_only('<tool_call>\n{"name": "get_weather", "argu'),
    content_only('<tool_call>\n{"function": "f", "arguments": {}}\n</tool_call>'),
    content_only('<tool_call>\n{"name": "f", "arguments": {}, "id": "1"}\n</tool_call>'),
    content_only('<tool_call>\n{"name": "f"}\n</tool_call>'),
    content_only('<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>'),
    content_only('<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>'),
    content_only('<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>'),
    content_only('<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>'),
    content_only('<tool_call>\n[{"name": "f", "arguments": {}}]\n</tool_call>'),
    content_only('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_cal>'),
    content_only("ends with a partial <tool_ca"),
    # A marker in prose, then a real call; a broken block, then a real one.
    ("Wrap calls in <tool_call> tags. " + PARIS, "Wrap calls in <tool_call> tags. ",
     [PARIS_CALL]),
    ("broken: " + UNCLOSED + TIME_BLOCK, "broken: " + UNCLOSED, [TIME_CALL]),
]


@pytest.mark.parametrize(("text", "content", "calls"), CORPUS)
def test_corpus_parses_and_streams_over_every_split(text, content, calls):
    assert_parses_to(PARSER, text, content, calls)


def test_any_cutting_of_the_corpus_streams_to_the_parse():
    assert_any_split_agrees(PARSER, CORPUS)


def test_a_call_is_given_when_its_block_closes():
    stream = PARSER.stream()
    assert stream.feed("Sure. <tool_") == ["Sure. "]
    assert stream.feed('call>\n{"name": "get_time", "arguments": {}}\n</tool_call') == []
    assert stream.feed(">\n") == [TIME_CALL, "\n"]
    assert stream.finish() == []


WEATHER_BLOCK = block("get_weather", '{"city": "Paris", "days": 3}')


def test_auto_tag_allows_text_and_calls():
    tag = PARSER.structural_tag(TOOLS, at_least_one=False, parallel=True)
    assert_round_trip(PARSER, tag, "Sure.", [], "Sure.")
    assert_round_trip(PARSER, tag, "Checking.\n" + WEATHER_BLOCK + "\n" + TIME_BLOCK + "\nOk",
                      [PARIS_CALL, TIME_CALL], "Checking.\n\n\nOk")


def test_required_tag_allows_calls_only():
    tag = PARSER.structural_tag(TOOLS, at_least_one=True, parallel=True)
    assert_round_trip(PARSER, tag, WEATHER_BLOCK + "\n" + TIME_BLOCK, [PARIS_CALL, TIME_CALL],
                      "\n")
    assert_calls_alone(tag, WEATHER_BLOCK)


def test_xgrammars_own_required_tag_lets_text_follow_the_calls():
    """Why ``required`` is built here: xgrammar's builtin Qwen 3 tag takes text after."""
    assert_builtin_required_tag_lets_text_follow("qwen_3", WEATHER_BLOCK, "\nDone.")


def test_not_parallel_allows_one_call():
    assert_one_call_without_parallel(PARSER, WEATHER_BLOCK, WEATHER_BLOCK + "\n" + TIME_BLOCK,
                                     TIME_BLOCK)


def test_named_function_tag_allows_that_function_only():
    assert_named_tag_takes_that_function_only(PARSER, TIME_BLOCK, TIME_CALL,
                                              '<tool_call>\n{"name": "get_weather"')


def test_tag_rejects_schema_violations():
    assert_tags_reject_schema_violations(PARSER, lambda arguments: block("get_weather", arguments))


def test_required_tag_needs_a_tool():
    assert_required_tag_needs_a_tool(PARSER)


@pytest.mark.default_model
def test_tag_takes_the_calls_as_the_default_models_tokens():
    assert_tokens_take_calls_alone(PARSER, WEATHER_BLOCK + "\n" + TIME_BLOCK, WEATHER_BLOCK)
