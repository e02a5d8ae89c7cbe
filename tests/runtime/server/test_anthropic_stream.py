"""A chat turn's output as Anthropic's message (``anthropic_stream.py``), over the real
parsers (Hermes-style ``<tool_call>`` blocks, ``deepseek-r1`` reasoning): the whole message's
blocks are the blocks its stream builds, in the model's order, for any split of the output;
blocks never overlap; and the stop reason's precedence.

The stream's blocks are built here by a reference reader of the events' JSON, as a client
reads the wire, not by the module's own ``assemble``.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.runtime.output_parsing.reasoning_parser import get_reasoning_parser
from radixlm.runtime.output_parsing.tool_call_registry import get_tool_call_parser
from radixlm.runtime.server.anthropic_stream import BlockWriter, message_content, stop_reason
from radixlm.runtime.server.chat_turn import ChatTurn


def turn(parallel: bool = True) -> ChatTurn:
    return ChatTurn(prompt_ids=[], sampling_params={}, tool_parser=get_tool_call_parser("qwen25"),
                    reasoning_parser=get_reasoning_parser("deepseek-r1"), thinking=True,
                    offered=frozenset({"f", "g"}), parallel_tool_calls=parallel)


def call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# Reasoning, text, a call, text, a call: the order the whole message once lost (it joined the
# texts into one block before the calls).
OUTPUT = f"Let me see.</think>\n\nA\n\n{call('f', {'x': 1})}\nB\n{call('g', {})}\n"


def streamed(chat_turn: ChatTurn, pieces: list[str]) -> list[dict]:
    """The stream's block events for ``pieces`` of an output, as the JSON sent."""
    writer, reader = BlockWriter(), chat_turn.stream()
    events = [e for piece in pieces for event in reader.feed(piece) for e in writer.take(event)]
    events += [e for event in reader.finish() for e in writer.take(event)] + writer.finish()
    return [event.model_dump(mode="json") for event in events]


def read_blocks(events: list[dict]) -> list[dict]:
    """The blocks a client builds from block events (a reference reader)."""
    blocks, inputs = [], {}
    for event in events:
        if event["type"] == "content_block_start":
            blocks.append(dict(event["content_block"]))
        elif event["type"] == "content_block_delta":
            block, delta = blocks[event["index"]], event["delta"]
            if delta["type"] == "input_json_delta":
                inputs[event["index"]] = inputs.get(event["index"], "") + delta["partial_json"]
            else:
                field = "text" if delta["type"] == "text_delta" else "thinking"
                block[field] += delta[field]
    for index, text in inputs.items():
        blocks[index]["input"] = json.loads(text)
    return blocks


def without_ids(blocks: list[dict]) -> list[dict]:
    return [{key: value for key, value in block.items() if key != "id"} for block in blocks]


def whole(chat_turn: ChatTurn, text: str) -> list[dict]:
    blocks, _ = message_content(chat_turn, text)
    return [block.model_dump(mode="json") for block in blocks]


def test_a_whole_message_has_the_blocks_in_the_order_the_model_wrote_them():
    blocks = whole(turn(), OUTPUT)
    assert [block["type"] for block in blocks] == [
        "thinking", "text", "tool_use", "text", "tool_use"]
    assert blocks[0]["thinking"] == "Let me see."
    assert [block["text"].strip() for block in blocks if block["type"] == "text"] == ["A", "B"]
    assert [(block["name"], block["input"]) for block in blocks
            if block["type"] == "tool_use"] == [("f", {"x": 1}), ("g", {})]
    assert all(block["id"].startswith("toolu_") for block in blocks[2::2])


def shape(blocks: list[dict]) -> list[tuple]:
    """Each block's kind and what it holds: what any split of an output keeps."""
    return [(block["type"], block.get("thinking"), block.get("text"),
             block.get("name"), block.get("input")) for block in blocks]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, len(OUTPUT)), max_size=12))
def test_any_split_of_the_output_streams_the_whole_messages_blocks(cuts):
    bounds = [0, *sorted(cuts), len(OUTPUT)]
    pieces = [OUTPUT[a:b] for a, b in zip(bounds, bounds[1:])]
    assert shape(read_blocks(streamed(turn(), pieces))) == shape(whole(turn(), OUTPUT))


def test_the_whole_output_in_one_delta_streams_exactly_the_whole_messages_blocks():
    assert without_ids(read_blocks(streamed(turn(), [OUTPUT]))) == without_ids(
        whole(turn(), OUTPUT))


def test_a_stream_fed_a_character_at_a_time_keeps_the_whole_messages_whitespace():
    assert without_ids(read_blocks(streamed(turn(), list(OUTPUT)))) == without_ids(
        whole(turn(), OUTPUT))


def test_blocks_never_overlap_and_count_up_from_zero():
    events = streamed(turn(), list(OUTPUT))
    open_index, started = None, 0
    for event in events:
        if event["type"] == "content_block_start":
            assert open_index is None and event["index"] == started
            open_index, started = event["index"], started + 1
        elif event["type"] == "content_block_delta":
            assert event["index"] == open_index
        else:
            assert event["type"] == "content_block_stop" and event["index"] == open_index
            open_index = None
    assert open_index is None and started == 5


def test_the_blank_between_calls_is_no_block_but_a_blank_answer_is_one():
    blocks = whole(turn(), f"</think>{call('f', {})}\n\n{call('g', {})}\n")
    assert [block["type"] for block in blocks] == ["tool_use", "tool_use"]
    assert whole(turn(), "</think> \n") == [{"type": "text", "text": " \n"}]


def test_without_parallel_calls_only_the_first_is_a_tool_use():
    blocks, called = message_content(turn(parallel=False), OUTPUT)
    assert called and [block.type for block in blocks] == ["thinking", "text", "tool_use", "text"]
    _, called = message_content(turn(), f"</think>{call('h', {})}")
    assert not called, "a call of a function not offered is dropped"


@pytest.mark.parametrize("finish, called, expected", [
    ({"type": "length", "length": 8}, True, ("max_tokens", None)),
    ({"type": "length", "length": 8}, False, ("max_tokens", None)),
    ({"type": "stop", "matched": "END"}, True, ("tool_use", None)),
    ({"type": "stop", "matched": "END"}, False, ("stop_sequence", "END")),
    ({"type": "stop", "matched": 2}, False, ("end_turn", None)),
    ({"type": "stop", "matched": "other"}, False, ("end_turn", None)),
    (None, False, ("end_turn", None)),
])
def test_the_stop_reason_puts_a_length_finish_first(finish, called, expected):
    assert stop_reason(finish, called, ["END"]) == expected
