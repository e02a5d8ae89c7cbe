"""DeepSeek-V3 and V3.1 tool calls (``tool_call_formats/deepseek.py``): a corpus of model-style
outputs for each parsed and streamed over every split; the structural tags checked with
xgrammar and against xgrammar's own tags for these models."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
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

from radixlm.runtime.output_parsing.block_parser import INCOMPLETE, INVALID
from radixlm.runtime.output_parsing.call_grammar import openai_tools
from radixlm.runtime.output_parsing.tool_call_formats.deepseek import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    SEP,
    DeepSeekV3ToolCallParser,
    DeepSeekV31ToolCallParser,
)
from radixlm.runtime.output_parsing.tool_call_types import ToolCall

V3 = DeepSeekV3ToolCallParser()
V31 = DeepSeekV31ToolCallParser()


def v3_call(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{arguments}\n```{CALL_END}"


def v31_call(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}{name}{SEP}{arguments}{CALL_END}"


WRITERS = {"deepseekv3": (V3, v3_call, "\n"), "deepseekv31": (V31, v31_call, "")}


def block(version: str, *calls: tuple[str, str]) -> str:
    _, write, separator = WRITERS[version]
    return CALLS_BEGIN + separator.join(write(n, a) for n, a in calls) + CALLS_END


def corpus(version: str) -> Corpus:
    """Outputs of ``version``: (text, content, calls)."""
    _, write, _ = WRITERS[version]
    tokyo = ("get_weather", '{"city": "Tokyo"}')
    paris = ("get_weather", '{"city": "Paris", "days": 3}')
    tokyo_call, paris_call = ToolCall(*tokyo), ToolCall(*paris)
    one = block(version, tokyo)
    unclosed = CALLS_BEGIN + write(*tokyo)
    bad_json = block(version, ("f", '{"a": 1,}'))
    array = block(version, ("f", "[1, 2]"))
    nan = block(version, ("f", '{"a": NaN}'))
    empty = CALLS_BEGIN + CALLS_END
    no_end = CALLS_BEGIN + CALL_BEGIN + "f" + SEP + '{"a": 1}' + CALLS_END
    other = block("deepseekv31" if version == "deepseekv3" else "deepseekv3", tokyo)
    return [
        ("", "", []),
        ("Tokyo is sunny today.", "Tokyo is sunny today.", []),
        (one, "", [tokyo_call]),
        (block(version, tokyo, paris), "", [tokyo_call, paris_call]),
        (block(version, paris, ("get_time", "{}"), tokyo), "",
         [paris_call, ToolCall("get_time", "{}"), tokyo_call]),
        ("Let me check. " + one, "Let me check. ", [tokyo_call]),
        (one + "\nIt is sunny.", "\nIt is sunny.", [tokyo_call]),
        (one + " then " + block(version, paris), " then ", [tokyo_call, paris_call]),
        # Whitespace between calls and around the JSON.
        (CALLS_BEGIN + "\n" + write(*tokyo) + "\n\n" + write(*paris) + "\n" + CALLS_END, "",
         [tokyo_call, paris_call]),
        (block(version, ("f", '  {"a": [1, {"b": null}]}  ')), "",
         [ToolCall("f", '{"a": [1, {"b": null}]}')]),
        (block(version, ("f", '{"q": "Zürich 東京 🌧 \\"x\\" \\n \\u00e9"}')), "",
         [ToolCall("f", '{"q": "Zürich 東京 🌧 \\"x\\" \\n \\u00e9"}')]),
        (block(version, ("f", '{"code": "```py\\nprint(1)\\n```"}')), "",
         [ToolCall("f", '{"code": "```py\\nprint(1)\\n```"}')]),
        # Malformed: content, byte for byte.
        (unclosed, unclosed, []),
        (bad_json, bad_json, []),
        (array, array, []),
        (nan, nan, []),
        (empty, empty, []),
        (no_end, no_end, []),
        (other, other, []),
        (CALLS_BEGIN + "I changed my mind.", CALLS_BEGIN + "I changed my mind.", []),
        ("The marker " + CALLS_BEGIN + " opens calls. " + one,
         "The marker " + CALLS_BEGIN + " opens calls. ", [tokyo_call]),
        (unclosed + one, unclosed, [tokyo_call]),
        ("<｜tool▁calls", "<｜tool▁calls", []),
        ("a < b and <｜ is special", "a < b and <｜ is special", []),
    ]


@pytest.mark.parametrize("version", WRITERS)
def test_corpus_parses_and_streams_over_every_split(version):
    for text, content, calls in corpus(version):
        assert_parses_to(WRITERS[version][0], text, content, calls)


@pytest.mark.parametrize("version", WRITERS)
def test_any_cutting_of_the_corpus_streams_to_the_parse(version):
    assert_any_split_agrees(WRITERS[version][0], corpus(version))


def test_a_name_stops_at_a_special_token():
    assert V31.match_block(CALLS_BEGIN + CALL_BEGIN + "f<｜tool▁", 0) is INCOMPLETE
    assert V31.match_block(CALLS_BEGIN + CALL_BEGIN + "f<｜tool▁call", 0) is INVALID
    assert V31.match_block(CALLS_BEGIN + CALL_BEGIN + "f" + CALL_END, 0) is INVALID
    assert V3.match_block(CALLS_BEGIN + CALL_BEGIN + "function" + SEP + "f" + SEP, 0) is INVALID


@pytest.mark.parametrize(("version", "model"),
                         [("deepseekv3", "deepseek_r1"), ("deepseekv31", "deepseek_v3_1")])
@pytest.mark.parametrize("parallel", [True, False])
def test_required_tag_is_xgrammars_own(version, model, parallel):
    ours = WRITERS[version][0].structural_tag(TOOLS, at_least_one=True, parallel=parallel)
    theirs = xgr.get_builtin_structural_tag(
        model, tools=openai_tools(TOOLS), tool_choice="required", reasoning=False,
        parallel_tool_calls=parallel)
    assert ours == theirs.model_dump()


def written(version: str, name: str, arguments: dict) -> tuple[str, ToolCall]:
    text = json.dumps(arguments)
    return WRITERS[version][1](name, text), ToolCall(name, text)


@pytest.mark.parametrize("version", WRITERS)
def test_auto_tag_allows_text_and_blocks(version):
    parser, _, separator = WRITERS[version]
    tag = parser.structural_tag(TOOLS, at_least_one=False, parallel=True)
    weather, weather_call = written(version, "get_weather", {"city": "Oslo", "days": 2})
    now, now_call = written(version, "get_time", {})
    assert_round_trip(parser, tag, "Plain text.", [], "Plain text.")
    text = "Checking. " + CALLS_BEGIN + weather + separator + now + CALLS_END + " Done."
    assert_round_trip(parser, tag, text, [weather_call, now_call], "Checking.  Done.")


@pytest.mark.parametrize("version", WRITERS)
def test_required_tag_allows_one_block_alone(version):
    parser, _, separator = WRITERS[version]
    tag = parser.structural_tag(TOOLS, at_least_one=True, parallel=True)
    weather, weather_call = written(version, "get_weather", {"city": "Oslo"})
    now, now_call = written(version, "get_time", {})
    assert_round_trip(parser, tag, CALLS_BEGIN + weather + separator + now + CALLS_END,
                      [weather_call, now_call])
    assert not accepts(tag, CALLS_BEGIN + CALLS_END)
    assert_calls_alone(tag, CALLS_BEGIN + weather + CALLS_END, after=" Done.")


@pytest.mark.parametrize("version", WRITERS)
def test_not_parallel_allows_one_call(version):
    parser, _, separator = WRITERS[version]
    weather, _ = written(version, "get_weather", {"city": "Oslo"})
    now, _ = written(version, "get_time", {})
    assert_one_call_without_parallel(parser, CALLS_BEGIN + now + CALLS_END,
                                     CALLS_BEGIN + weather + separator + now + CALLS_END,
                                     CALLS_BEGIN + now + CALLS_END)
    tag = parser.structural_tag(TOOLS, at_least_one=False, parallel=False)
    assert not accepts(tag, CALLS_BEGIN + now + CALLS_END + " and " + CALLS_BEGIN + now
                       + CALLS_END)


@pytest.mark.parametrize("version", WRITERS)
def test_tag_rejects_schema_violations(version):
    parser, write, _ = WRITERS[version]
    tag = parser.structural_tag([WEATHER], at_least_one=True, parallel=True)
    for arguments in ('{"days": 3}', '{"city": "Oslo", "days": "3"}',
                      '{"city": "Oslo", "unit": "kelvin"}', '{"town": "Oslo"}'):
        assert not accepts(tag, CALLS_BEGIN + write("get_weather", arguments) + CALLS_END)
    assert not accepts_prefix(tag, CALLS_BEGIN + write("get_time", "{}"))
    weather, weather_call = written(version, "get_weather", {"city": "Oslo", "unit": "celsius"})
    assert_round_trip(parser, tag, CALLS_BEGIN + weather + CALLS_END, [weather_call])


def test_named_function_tag_allows_that_function_only():
    assert_named_tag_takes_that_function_only(
        V31, CALLS_BEGIN + v31_call("get_time", "{}") + CALLS_END, ToolCall("get_time", "{}"),
        CALLS_BEGIN + CALL_BEGIN + "get_weather")


def test_required_tag_needs_a_tool():
    assert_required_tag_needs_a_tool(V3)


@pytest.mark.default_model
@pytest.mark.parametrize("version", WRITERS)
def test_default_model_may_only_open_a_block_under_the_required_tag(version):
    assert_default_model_opens_only_calls(WRITERS[version][0], CALLS_BEGIN)
