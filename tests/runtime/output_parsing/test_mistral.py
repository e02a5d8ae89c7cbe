"""The Mistral formats (``tool_call_formats/mistral.py``; mistral): a corpus of model-style
outputs in the array and the compact form, parsed, streamed over every split, and the
structural tag (the array form) checked with a real xgrammar matcher."""

from __future__ import annotations

import pytest
from structural_tag_checks import TIME as TIME_TOOL
from structural_tag_checks import TOOLS, WEATHER, accepts, accepts_prefix, assert_round_trip
from token_checks import accepts_tokens
from tool_call_checks import assert_any_split_agrees, assert_stream_agrees

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


def same(text: str) -> tuple[str, str, list[ToolCall]]:
    """An output with no call: all of it is content."""
    return text, text, []


CORPUS: list[tuple[str, str, list[ToolCall]]] = [
    same(""),
    same("The weather in Paris is sunny."),
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
    same('[TOOL_CALLS] [{"name": "f", "arguments": {"a": }}]'),
    same("[TOOL_CALLS] [" + PARIS),
    same('[TOOL_CALLS] [{"name": "f", "parameters": {}}]'),
    same('[TOOL_CALLS] [{"name": "f", "arguments": {}, "extra": 1}]'),
    same('[TOOL_CALLS] [{"name": "f", "arguments": "{}"}]'),
    same("[TOOL_CALLS] [" + PARIS + ", 1]"),
    same("[TOOL_CALLS] []"),
    same('[TOOL_CALLS] {"name": "f", "arguments": {}}'),
    same('[TOOL_CALLS]get_weather {"city": "Paris"}'),
    same("[TOOL_CALLS]f[ARGS][1]"),
    same('[TOOL_CALLS]f[ARGS]{"a": NaN}'),
    same("[TOOL_CALLS]f[CALL_ID][ARGS]{}"),
    same("[TOOL_CALLS][ARGS]{}"),
    same("[TOOL_CALLS]get_weather[ARG"),
    same("ends with a partial [TOOL_CA"),
    # A marker in prose, then a real call.
    ("The [TOOL_CALLS] token starts calls. " + array(TIME),
     "The [TOOL_CALLS] token starts calls. ", [TIME_CALL]),
]


@pytest.mark.parametrize(("text", "content", "calls"), CORPUS)
def test_corpus_parses_and_streams_over_every_split(text, content, calls):
    parsed = assert_stream_agrees(PARSER, text)
    assert parsed.content == content
    assert parsed.calls == calls


def test_any_cutting_of_the_corpus_streams_to_the_parse():
    assert_any_split_agrees(PARSER, [text for text, _, _ in CORPUS])


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
    assert not accepts(tag, "")
    assert not accepts(tag, "[TOOL_CALLS] []")
    assert not accepts_prefix(tag, "Sure")
    assert not accepts(tag, "Sure. " + array(PARIS))
    assert not accepts(tag, array(PARIS) + "\nDone.")


def test_not_parallel_allows_one_call():
    for at_least_one in (False, True):
        tag = PARSER.structural_tag(TOOLS, at_least_one=at_least_one, parallel=False)
        assert accepts(tag, array(PARIS))
        assert not accepts(tag, array(PARIS, TIME))
    assert accepts(PARSER.structural_tag(TOOLS, False, False), "Text first. " + array(TIME))


def test_named_function_tag_allows_that_function_only():
    tag = PARSER.structural_tag([TIME_TOOL], at_least_one=True, parallel=False)
    assert_round_trip(PARSER, tag, array(TIME), [TIME_CALL])
    assert not accepts_prefix(tag, '[TOOL_CALLS] [{"name": "get_weather"')


def test_tag_rejects_schema_violations():
    for at_least_one in (False, True):
        tag = PARSER.structural_tag([WEATHER], at_least_one=at_least_one, parallel=True)
        assert not accepts(tag, array(element("get_weather", '{"days": 3}')))
        assert not accepts_prefix(tag, array(element("get_weather", '{"city": "P", "days": "3"}')))
        assert not accepts_prefix(tag, array(element("get_weather", '{"unit": "kelvin"}')))
        oslo = '{"city": "Oslo", "unit": "celsius"}'
        assert_round_trip(PARSER, tag, array(element("get_weather", oslo)),
                          [ToolCall("get_weather", oslo)])


def test_required_tag_needs_a_tool():
    with pytest.raises(ValueError, match="no tools"):
        PARSER.structural_tag([], at_least_one=True, parallel=True)
    assert accepts(PARSER.structural_tag([], at_least_one=False, parallel=True), "any text")


@pytest.mark.default_model
def test_tag_takes_the_calls_as_the_default_models_tokens():
    tag = PARSER.structural_tag(TOOLS, at_least_one=True, parallel=True)
    assert accepts_tokens(tag, array(PARIS, TIME))
    assert not accepts_tokens(tag, "Sure. " + array(PARIS))
