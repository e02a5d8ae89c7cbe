"""``chat_turn.py`` without a model: how a turn's output is read (any split of a stream reads
as the whole), which calls it gives, the grammars it builds and the input it refuses."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.runtime.grammar.xgrammar_backend import _structural_tag_text, check_constraint
from radixlm.runtime.output_parsing.reasoning_parser import get_reasoning_parser
from radixlm.runtime.output_parsing.tool_call_registry import get_tool_call_parser
from radixlm.runtime.output_parsing.tool_call_types import FunctionTool, ToolCall
from radixlm.runtime.server.chat_turn import (
    ChatTurn,
    ChatTurnError,
    ContentDelta,
    ReasoningDelta,
    ToolChoice,
    TurnOutput,
    allowing_reasoning_first,
    check_tool_messages,
    check_tools,
    tool_grammar,
)

ZONE = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "JST"]}},
        "required": ["zone"]}
TOOLS = [FunctionTool("get_time", ZONE), FunctionTool("ping")]


def call(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


OUTPUTS = [
    "Hello there.\n",
    "<think>Which zone?</think>\n\nUTC, I think. ",
    f"<think>a tool</think>Let me check.\n\n{call('get_time', {'zone': 'UTC'})}\n",
    f"{call('get_time', {'zone': 'UTC'})}\n{call('ping', {})}\n",
    f"A  \n{call('rm', {})}\n\nB \n{call('ping', {})}\n \n",
    f"<think>x</think>{call('ping', {})}\n<tool_call>\n{{broken\n</tool_call>  ",
]


def turn(parallel: bool = True) -> ChatTurn:
    return ChatTurn([], {}, get_tool_call_parser("qwen25"), get_reasoning_parser("qwen3"),
                    thinking=True, offered=frozenset({"get_time", "ping"}),
                    parallel_tool_calls=parallel)


def joined(events: list) -> TurnOutput:
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    return TurnOutput(reasoning or None, "".join(e.text for e in events
                                                  if isinstance(e, ContentDelta)),
                      [e for e in events if isinstance(e, ToolCall)])


def streamed(chat: ChatTurn, pieces: list[str]) -> list:
    stream = chat.stream()
    return [event for piece in pieces for event in stream.feed(piece)] + stream.finish()


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(OUTPUTS), st.lists(st.integers(0, 200), max_size=10))
def test_any_split_of_an_output_gives_the_events_of_the_whole(text, cuts):
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    whole = streamed(turn(), [text])
    assert _merged(streamed(turn(), pieces)) == _merged(whole)
    assert joined(whole) == turn().read(text)


def _merged(events: list) -> list:
    """Adjacent events of one kind of text joined (a stream may cut text anywhere)."""
    out: list = []
    for event in events:
        if out and type(event) is type(out[-1]) and not isinstance(event, ToolCall):
            out[-1] = type(event)(out[-1].text + event.text)
        else:
            out.append(event)
    return out


def test_calls_to_unoffered_functions_are_dropped_and_blanks_around_calls_too():
    read = turn().read(OUTPUTS[4])
    assert [c.name for c in read.tool_calls] == ["ping"]
    assert read.content == "A  \n\n\nB"


def test_without_parallel_calls_only_the_first_is_given():
    read = turn(parallel=False).read(OUTPUTS[3])
    assert read.tool_calls == [ToolCall("get_time", '{"zone": "UTC"}')]


def test_reasoning_comes_first_and_a_broken_call_is_content():
    read = turn().read(OUTPUTS[5])
    assert read.reasoning == "x" and [c.name for c in read.tool_calls] == ["ping"]
    assert read.content == "\n<tool_call>\n{broken\n</tool_call>"


def accepts(tag: dict, text: str) -> bool:
    grammar = xgr.Grammar.from_structural_tag(_structural_tag_text(json.dumps(tag)))
    return xgr.testing._is_grammar_accept_string(grammar, text)


def test_auto_with_a_response_schema_is_calls_or_a_value_of_the_schema():
    answer = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"]}
    tag = tool_grammar(get_tool_call_parser("qwen25"), TOOLS, ToolChoice("auto"), True, answer)
    check_constraint("structural_tag", json.dumps(tag))
    assert accepts(tag, call("get_time", {"zone": "JST"}))
    assert accepts(tag, '{"city": "Lima"}')
    assert not accepts(tag, '{"town": "Lima"}')
    assert not accepts(tag, "Lima")
    assert not accepts(tag, call("get_time", {"zone": "CET"}))


def test_a_required_call_may_follow_thinking():
    tag = tool_grammar(get_tool_call_parser("qwen25"), TOOLS, ToolChoice("required"), False)
    thinking = allowing_reasoning_first(tag, get_reasoning_parser("qwen3"))
    assert accepts(thinking, "<think>hm</think>" + call("ping", {}))
    assert accepts(thinking, call("ping", {}))
    assert not accepts(thinking, "hm" + call("ping", {}))
    opened = allowing_reasoning_first(tag, get_reasoning_parser("deepseek-r1"))
    assert accepts(opened, "hm</think>" + call("ping", {}))


@pytest.mark.parametrize(("tools", "choice", "param"), [
    (TOOLS + [FunctionTool("ping")], ToolChoice(), "tools[2].name"),
    ([FunctionTool("f", {"type": "array"})], ToolChoice(), "tools[0].parameters"),
    (TOOLS, ToolChoice("function", "nope"), "tool_choice"),
    ([], ToolChoice("required"), "tool_choice"),
])
def test_bad_tools_are_refused_naming_the_field(tools, choice, param):
    with pytest.raises(ChatTurnError) as refused:
        check_tools(tools, choice)
    assert refused.value.param == param


def test_a_tool_message_must_answer_an_earlier_call():
    asked = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "ping", "arguments": {}}}]}
    check_tool_messages([asked, {"role": "tool", "tool_call_id": "c1", "content": "ok"}])
    with pytest.raises(ChatTurnError) as refused:
        check_tool_messages([{"role": "tool", "tool_call_id": "c1", "content": "ok"}, asked])
    assert refused.value.param == "messages[0].tool_call_id"
