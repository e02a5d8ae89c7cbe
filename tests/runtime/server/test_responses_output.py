"""A turn's events as Responses output items: which items a sequence of events makes (an
output read by the chat turn's own ``TurnStream``, which settles whitespace, for the
whitespace cases), and that the stream events describe exactly those items (every item
opened is closed, deltas build its text, the closed items in order are the items)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from radixlm.runtime.output_parsing.reasoning_parser import get_reasoning_parser
from radixlm.runtime.output_parsing.tool_call_registry import get_tool_call_parser
from radixlm.runtime.output_parsing.tool_call_types import ToolCall
from radixlm.runtime.server.chat_turn import ContentDelta, ReasoningDelta, TurnStream
from radixlm.runtime.server.responses_output import OutputItems


def build(events, complete=True):
    items = OutputItems()
    stream = [e for event in events for e in items.add(event)] + items.finish(complete)
    return items.items, stream


def shapes(items):
    """Each item as (type, text or call)."""
    return [(item["type"], item["name"] + item["arguments"]) if item["type"] == "function_call"
            else (item["type"], item["content"][0]["text"]) for item in items]


CALL_A, CALL_B = ToolCall("a", '{"x": 1}'), ToolCall("b", "{}")


def read(pieces, reasoning=False, complete=True):
    """The items of an output arriving in ``pieces``, read as a chat turn reads it (Qwen 2.5's
    calls; DeepSeek-R1's reasoning, which the output begins inside, where asked)."""
    stream = TurnStream(get_tool_call_parser("qwen25"),
                        get_reasoning_parser("deepseek-r1") if reasoning else None,
                        thinking=reasoning, offered=frozenset("ab"))
    events = [event for piece in pieces for event in stream.feed(piece)] + stream.finish()
    return build(events, complete)[0]


def call(name, arguments):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def test_whitespace_between_and_after_calls_makes_no_message():
    items = read([call("a", '{"x": 1}'), "\n", call("b", "{}"), " \n"])
    assert shapes(items) == [("function_call", 'a{"x": 1}'), ("function_call", "b{}")]


def test_reasoning_and_content_runs_are_one_item_each():
    items = read(["let ", "me</think>", "\n", "Hi", " there"], reasoning=True)
    assert shapes(items) == [("reasoning", "let me"), ("message", "Hi there")]
    assert [item["status"] for item in items] == ["completed", "completed"]


def test_text_after_a_call_keeps_the_space_before_it():
    items = read([call("a", "{}"), "\n", "\nDone."])
    assert shapes(items) == [("function_call", "a{}"), ("message", "\n\nDone.")]


def test_a_turn_with_nothing_to_show_answers_an_empty_message():
    items, _ = build([ReasoningDelta("hmm")], complete=False)
    assert shapes(items) == [("reasoning", "hmm"), ("message", "")]
    assert items[0]["status"] == "incomplete" and items[1]["status"] == "incomplete"
    assert shapes(read(["  "])) == [("message", "  ")]


def test_calls_have_their_own_ids():
    items, _ = build([CALL_A, CALL_A])
    assert items[0]["id"].startswith("fc_") and items[0]["call_id"].startswith("call_")
    assert len({item["id"] for item in items}) == len({item["call_id"] for item in items}) == 2


turn_events = st.lists(st.one_of(
    st.builds(ReasoningDelta, st.sampled_from(["a", " ", "\n", "bc"])),
    st.builds(ContentDelta, st.sampled_from(["x", " ", "\n", "yz"])),
    st.sampled_from([CALL_A, CALL_B])), max_size=12)


@given(turn_events, st.booleans())
def test_the_stream_events_describe_the_items(events, complete):
    items, stream = build(events, complete)
    opened, texts, done = {}, {}, []
    for event in stream:
        kind = event["type"]
        if kind == "response.output_item.added":
            assert event["output_index"] == len(opened)
            opened[event["output_index"]] = event["item"]["id"]
        elif kind.endswith(".delta"):
            assert event["item_id"] == opened[event["output_index"]]
            assert event["output_index"] == len(done)  # deltas go to the open item
            texts[event["item_id"]] = texts.get(event["item_id"], "") + event["delta"]
        elif kind == "response.output_item.done":
            assert event["output_index"] == len(done)
            done.append(event["item"])
    assert done == items and len(opened) == len(items)
    for item in items:
        text = (item["arguments"] if item["type"] == "function_call"
                else item["content"][0]["text"])
        assert texts.get(item["id"], "") == text
    assert sum(item["type"] != "reasoning" for item in items) >= 1
