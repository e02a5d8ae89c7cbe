"""The Mistral formats (``tool_call_formats/mistral.py``; mistral): a corpus of model-style
outputs in the array and the compact form, parsed, streamed over every split, and the
structural tag (the array form) checked with a real xgrammar matcher."""

from __future__ import annotations

import pytest
from structural_tag_checks import (
    TOOLS,
    accepts,
    assert_calls_alone,
    assert_named_tag_takes_that_function_only,
    assert_one_call_without_parallel,
    assert_required_tag_needs_a_tool,
    assert_round_trip,
    assert_tags_reject_schema_violations,
)
from token_checks import assert_tokens_take_calls_alone
from tool_call_checks import Corpus, assert_any_split_agrees, assert_parses_to, content_only

from radixlm.runtime.output_parsing.tool_call_formats.mistral import MistralToolCallParser
from radixlm.runtime.output_parsing.tool_call_types import ToolCall

PARSER = MistralToolCallParser()


def element(name: str, arguments: str) -> str:
    return f'{{"name": "{name}", "arguments": {arguments}}}'


def array(*elements: str) -> str:
    """A block of the array form, as the constrained form writes it."""
    return "[TOOL_CALLS] [" + ", ".join(elements) + "]"


PARIS_ARGS = '{"city": "Paris", "days": 3}'
PARIS = element("get_weather", PARIS_ARGS)
PARIS_CALL = ToolCall("get_weather", PARIS_ARGS)
TIME = element("get_time", "{}")
TIME_CALL = ToolCall("get_time", "{}")
NESTED = '{"filter": {"and": [{"x": 1}, {"y": [true, null, -1.5e-3]}]}}'
UNICODE = '{"city": "Zürich 東京 🌧", "note": "\\u00e9"}'
ESCAPED = '{"q": "a ] b [TOOL_CALLS] c \\"q\\" [ARGS]\\\\"}'


CORPUS: Corpus = [
    content_only(""),
    content_only("The weather in Paris is sunny."),
    (array(PARIS), "", [PARIS_CALL]),
    ("[TOOL_CALLS][" + PARIS + "," + TIME + "]", "", [PARIS_CALL, TIME_CALL]),
    ('[TOOL_CALLS]  [{"name": "get_time", "arguments": {}, "id": "abc123def"}]', "",
     [TIME_CALL]),
    ("Let me check.\n" + array(PARIS), "Let me check.\n", [PARIS_CALL]),
    (array(TIME) + "\nDone.", "\nDone.", [TIME_CALL]),
    (array(element("search", NESTED), element("w", UNICODE)), "",
     [ToolCall("search", NESTED), ToolCall("w", UNICODE)]),
    (array(element("ask", ESCAPED)), "", [ToolCall("ask", ESCAPED)]),
    ("[TOOL_CALLS]get_weather[ARGS]" + PARIS_ARGS, "", [PARIS_CALL]),
    ("[TOOL_CALLS]get_weather[ARGS]" + PARIS_ARGS + "[TOOL_CALLS]get_time[ARGS]{}", "",
     [PARIS_CALL, TIME_CALL]),
    ("[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{}", "", [TIME_CALL]),
    ("Sure. [TOOL_CALLS]ask[ARGS]" + ESCAPED + " ok", "Sure.  ok", [ToolCall("ask", ESCAPED)]),
    ('[TOOL_CALLS]my.tool-2_x[ARGS] {"b":1,  "a" : [ 1,2 ]}', "",
     [ToolCall("my.tool-2_x", '{"b":1,  "a" : [ 1,2 ]}')]),
    (array(TIME) + "[TOOL_CALLS]get_weather[ARGS]" + PARIS_ARGS, "", [TIME_CALL, PARIS_CALL]),
    # Malformed: content, byte for byte.
    content_only('[TOOL_CALLS] [{"name": "f", "arguments": {"a": }}]'),
    content_only("[TOOL_CALLS] [" + PARIS),
    content_only('[TOOL_CALLS] [{"name": "f", "parameters": {}}]'),
    content_only('[TOOL_CALLS] [{"name": "f", "arguments": {}, "extra": 1}]'),
    content_only('[TOOL_CALLS] [{"name": "f", "arguments": "{}"}]'),
    content_only("[TOOL_CALLS] [" + PARIS + ", 1]"),
    content_only("[TOOL_CALLS] []"),
    content_only('[TOOL_CALLS] {"name": "f", "arguments": {}}'),
    content_only('[TOOL_CALLS]get_weather {"city": "Paris"}'),
    content_only("[TOOL_CALLS]f[ARGS][1]"),
    content_only('[TOOL_CALLS]f[ARGS]{"a": NaN}'),
    content_only("[TOOL_CALLS]f[CALL_ID][ARGS]{}"),
    content_only("[TOOL_CALLS][ARGS]{}"),
    content_only("[TOOL_CALLS]get_weather[ARG"),
    content_only("ends with a partial [TOOL_CA"),
    # A marker in prose, then a real call.
    ("The [TOOL_CALLS] token starts calls. " + array(TIME),
     "The [TOOL_CALLS] token starts calls. ", [TIME_CALL]),
]


@pytest.mark.parametrize(("text", "content", "calls"), CORPUS)
def test_corpus_parses_and_streams_over_every_split(text, content, calls):
    assert_parses_to(PARSER, text, content, calls)


def test_any_cutting_of_the_corpus_streams_to_the_parse():
    assert_any_split_agrees(PARSER, CORPUS)


def test_compact_calls_are_given_when_their_arguments_close():
    stream = PARSER.stream()
    assert stream.feed("Ok [TOOL_CALLS]get_ti") == ["Ok "]
    assert stream.feed("me[ARGS]{") == []
    assert stream.feed("}[TOOL_") == [TIME_CALL]
    assert stream.finish() == ["[TOOL_"]


def test_auto_tag_allows_text_then_one_block_of_calls():
    tag = PARSER.structural_tag(TOOLS, at_least_one=False, parallel=True)
    assert_round_trip(PARSER, tag, "Sure.", [], "Sure.")
    assert_round_trip(PARSER, tag, "Checking.\n" + array(PARIS, TIME), [PARIS_CALL, TIME_CALL],
                      "Checking.\n")
    assert not accepts(tag, array(PARIS) + " Done.")
    assert not accepts(tag, array(PARIS) + array(TIME))


def test_required_tag_allows_calls_only():
    tag = PARSER.structural_tag(TOOLS, at_least_one=True, parallel=True)
    assert_round_trip(PARSER, tag, array(PARIS, TIME), [PARIS_CALL, TIME_CALL])
    assert not accepts(tag, "[TOOL_CALLS] []")
    assert_calls_alone(tag, array(PARIS))


def test_not_parallel_allows_one_call():
    assert_one_call_without_parallel(PARSER, array(PARIS), array(PARIS, TIME), array(TIME))


def test_named_function_tag_allows_that_function_only():
    assert_named_tag_takes_that_function_only(PARSER, array(TIME), TIME_CALL,
                                              '[TOOL_CALLS] [{"name": "get_weather"')


def test_tag_rejects_schema_violations():
    assert_tags_reject_schema_violations(
        PARSER, lambda arguments: array(element("get_weather", arguments)))


def test_required_tag_needs_a_tool():
    assert_required_tag_needs_a_tool(PARSER)


@pytest.mark.default_model
def test_tag_takes_the_calls_as_the_default_models_tokens():
    assert_tokens_take_calls_alone(PARSER, array(PARIS, TIME), array(PARIS))
