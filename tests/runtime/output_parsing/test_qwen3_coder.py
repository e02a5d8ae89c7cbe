"""Qwen3-Coder's XML tool calls (``tool_call_formats/qwen3_coder.py``): a corpus of model-style
outputs parsed, streamed over every split, and the structural tag checked with xgrammar."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
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
    assert_one_call_without_parallel,
    assert_required_tag_needs_a_tool,
    assert_round_trip,
)
from tool_call_checks import Corpus, assert_any_split_agrees, assert_parses_to

from radixlm.runtime.output_parsing.call_grammar import openai_tools
from radixlm.runtime.output_parsing.tool_call_formats.qwen3_coder import (
    Qwen3CoderToolCallParser,
    parameter_value,
)
from radixlm.runtime.output_parsing.tool_call_types import FunctionTool, ToolCall

PARSER = Qwen3CoderToolCallParser()


def call(name: str, *params: tuple[str, str]) -> str:
    """A block as the chat template writes it."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def tc(name: str, **arguments) -> ToolCall:
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


PARIS = call("get_weather", ("city", "Paris"), ("days", "3"))
PARIS_CALL = tc("get_weather", city="Paris", days=3)
UNCLOSED = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"

CORPUS: Corpus = [
    ("", "", []),
    ("The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    (PARIS, "", [PARIS_CALL]),
    ("Let me check.\n" + PARIS, "Let me check.\n", [PARIS_CALL]),
    (PARIS + "\nDone.", "\nDone.", [PARIS_CALL]),
    (PARIS + "\n" + call("get_time"), "\n", [PARIS_CALL, tc("get_time")]),
    (call("get_time") + call("get_time"), "", [tc("get_time"), tc("get_time")]),
    # JSON values load as JSON; other text stays a string.
    (call("f", ("n", "-2.5e3"), ("ok", "true"), ("none", "null"), ("s", '"quoted"')), "",
     [tc("f", n=-2500.0, ok=True, none=None, s="quoted")]),
    (call("f", ("obj", '{"a": [1, 2], "b": {"c": "d"}}'), ("arr", "[1, \"x\"]")), "",
     [tc("f", obj={"a": [1, 2], "b": {"c": "d"}}, arr=[1, "x"])]),
    (call("f", ("text", "line one\nline two")), "", [tc("f", text="line one\nline two")]),
    (call("f", ("text", "Zürich 東京 🌧 a<b & \"q\" \\n")), "",
     [tc("f", text="Zürich 東京 🌧 a<b & \"q\" \\n")]),
    (call("f", ("nan", "NaN"), ("big", "1e999"), ("x", "{not json")), "",
     [tc("f", nan="NaN", big="1e999", x="{not json")]),
    (call("f", ("empty", "")), "", [tc("f", empty="")]),
    # Compact whitespace, as xgrammar's qwen_xml also allows.
    ("<tool_call><function=f><parameter=a>1</parameter></function></tool_call>", "",
     [tc("f", a=1)]),
    # Malformed: content, byte for byte.
    (UNCLOSED, UNCLOSED, []),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
     "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
     []),
    ("<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
     "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>", []),
    ("<tool_call>\n<function=>\n</function>\n</tool_call>",
     "<tool_call>\n<function=>\n</function>\n</tool_call>", []),
    ("<tool_call>\n<function=bad\nname>\n</function>\n</tool_call>",
     "<tool_call>\n<function=bad\nname>\n</function>\n</tool_call>", []),
    (call("f", ("a", "1"), ("a", "2")), call("f", ("a", "1"), ("a", "2")), []),
    ("<tool_call>\n<function=f>\n</function>\ntrailing\n</tool_call>",
     "<tool_call>\n<function=f>\n</function>\ntrailing\n</tool_call>", []),
    # A marker in prose, then a real call.
    ("Qwen wraps calls in <tool_call> tags. " + PARIS,
     "Qwen wraps calls in <tool_call> tags. ", [PARIS_CALL]),
    ("Use <tool_call to start", "Use <tool_call to start", []),
    ("a broken " + UNCLOSED + call("get_time"), "a broken " + UNCLOSED, [tc("get_time")]),
    ("ends with a partial <tool_ca", "ends with a partial <tool_ca", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), CORPUS)
def test_corpus_parses_and_streams_over_every_split(text, content, calls):
    assert_parses_to(PARSER, text, content, calls)


def test_any_cutting_of_the_corpus_streams_to_the_parse():
    assert_any_split_agrees(PARSER, CORPUS)


def test_parameter_values_fall_back_to_their_text():
    assert parameter_value("42") == 42
    assert parameter_value("Paris") == "Paris"
    assert parameter_value("[1e999]") == "[1e999]"
    assert parameter_value('"\\ud800"') == '"\\ud800"'
    assert parameter_value("[" * 100_000) == "[" * 100_000


WEATHER_CALL = call("get_weather", ("city", "Paris"), ("days", "3"))
TIME_CALL = call("get_time")


def test_auto_tag_allows_text_and_calls():
    tag = PARSER.structural_tag(TOOLS, at_least_one=False, parallel=True)
    assert_round_trip(PARSER, tag, "Sure.", [], "Sure.")
    assert_round_trip(PARSER, tag, "Checking.\n" + WEATHER_CALL + "\n" + TIME_CALL + "\nOk",
                      [tc("get_weather", city="Paris", days=3), tc("get_time")],
                      "Checking.\n\n\nOk")


def test_required_tag_allows_calls_only():
    tag = PARSER.structural_tag(TOOLS, at_least_one=True, parallel=True)
    assert_round_trip(PARSER, tag, WEATHER_CALL + "\n" + TIME_CALL,
                      [tc("get_weather", city="Paris", days=3), tc("get_time")], "\n")
    assert_calls_alone(tag, WEATHER_CALL)


def test_xgrammars_own_required_tag_lets_text_follow_which_ours_does_not():
    theirs = xgr.get_builtin_structural_tag("qwen_3_coder", tools=openai_tools(TOOLS),
                                            tool_choice="required", reasoning=False).model_dump()
    assert accepts(theirs, WEATHER_CALL + "\nDone.")
    assert not accepts(PARSER.structural_tag(TOOLS, True, True), WEATHER_CALL + "\nDone.")
    assert not accepts(theirs, TIME_CALL)  # it wants a blank line where no parameters are


def test_not_parallel_allows_one_call():
    assert_one_call_without_parallel(PARSER, WEATHER_CALL, WEATHER_CALL + "\n" + TIME_CALL,
                                     TIME_CALL)


def test_named_function_tag_allows_that_function_only():
    assert_named_tag_takes_that_function_only(PARSER, TIME_CALL, tc("get_time"),
                                              "<tool_call>\n<function=get_weather")


def test_tag_rejects_schema_violations():
    tag = PARSER.structural_tag([WEATHER], at_least_one=True, parallel=True)
    assert not accepts(tag, call("get_weather", ("days", "3")))  # city is required
    assert not accepts_prefix(tag, call("get_weather", ("city", "Paris"), ("days", "three")))
    assert not accepts_prefix(tag, call("get_weather", ("city", "Paris"), ("unit", "kelvin")))
    assert not accepts_prefix(tag, call("get_weather", ("town", "Paris")))
    assert_round_trip(PARSER, tag, call("get_weather", ("city", "Oslo"), ("unit", "celsius")),
                      [tc("get_weather", city="Oslo", unit="celsius")])


def test_required_tag_needs_a_tool():
    assert_required_tag_needs_a_tool(PARSER)


@pytest.mark.default_model
def test_default_model_may_only_open_a_call_under_the_required_tag():
    assert_default_model_opens_only_calls(PARSER, "<tool_call>\n<function=")


NOTE = FunctionTool("note", {
    "type": "object",
    "properties": {"text": {"type": "string"}, "count": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string"}},
                   "meta": {"type": "object", "properties": {"ok": {"type": "boolean"}}}},
    "required": ["text"],
})


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=12).filter(lambda s: parameter_value(s) == s),
       count=st.none() | st.integers(), tags=st.none() | st.lists(st.text(max_size=4)),
       meta=st.none() | st.fixed_dictionaries({"ok": st.booleans()}))
def test_values_written_as_the_template_writes_them_parse_back(text, count, tags, meta):
    written = {key: value for key, value in
               {"text": text, "count": count, "tags": tags, "meta": meta}.items()
               if value is not None}
    params = [(key, value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
              for key, value in written.items()]
    tag = PARSER.structural_tag([NOTE], at_least_one=True, parallel=False)
    source = call("note", *params)
    if "</parameter>" in text:  # a value cannot hold its own end tag
        assert not accepts(tag, source)
        return
    assert_round_trip(PARSER, tag, source, [tc("note", **written)])
