"""The block cursor (``tool_call_formats/block_reading.py``): its reads stop with answers that
no longer text changes, so a ``match_block`` written with them is monotone."""

from __future__ import annotations

import json

from hypothesis import example, given, settings
from hypothesis import strategies as st

from radixlm.runtime.output_parsing.block_parser import INCOMPLETE, INVALID, Block
from radixlm.runtime.output_parsing.tool_call_formats.block_reading import (
    BlockCursor,
    json_object_text,
    literal_end,
    read_block,
    skip_space,
)
from radixlm.runtime.output_parsing.tool_call_types import ToolCall


def read_sample(cursor: BlockCursor) -> Block:
    """A small format: ``<<``, space, then fields, each ``+`` and text up to ``!;`` (holding
    no ``!``, which begins the terminator, nor ``<<``), until ``..`` ends the block."""
    cursor.literal("<<")
    fields = []
    while True:
        cursor.skip_space()
        choice, _ = cursor.one_of("+", "..")
        if choice == 1:
            cursor.fail_unless(bool(fields))
            return Block([ToolCall("sample", json.dumps({"fields": fields}))], cursor.pos)
        fields.append(cursor.until("!;", forbidden=("!", "<<")))


@settings(max_examples=400, deadline=None)
@example("<< +a!; +b!;..tail")
@example("<< +a!!;..")
@example("<< +a<;<<!;..")
@given(st.text("<+;.! ab", max_size=24).map(lambda tail: "<<" + tail))
def test_a_definite_answer_holds_for_every_longer_text(text):
    whole = read_block(text, 0, read_sample)
    for end in range(len(text)):
        prefix = read_block(text[:end], 0, read_sample)
        if prefix is not INCOMPLETE:
            assert prefix == whole, (text[:end], prefix, whole)


def test_reads_answer_as_far_as_the_text_decides():
    assert read_block("<", 0, read_sample) is INCOMPLETE
    assert read_block("<x", 0, read_sample) is INVALID
    assert read_block("<< +ab!", 0, read_sample) is INCOMPLETE
    assert read_block("<< +a!b", 0, read_sample) is INVALID
    assert read_block("<< +ab<", 0, read_sample) is INCOMPLETE
    assert read_block("<< +ab<<", 0, read_sample) is INVALID
    assert read_block("<< ..", 0, read_sample) is INVALID
    block = read_block("x<< +a!;\n+!; ..y", 1, read_sample)
    assert block == Block([ToolCall("sample", '{"fields": ["a", ""]}')], 15)


def test_json_object_text_refuses_what_json_cannot_hold():
    assert json_object_text({"a": "é", "b": [1, None]}) == '{"a": "é", "b": [1, null]}'
    assert json_object_text({"a": float("inf")}) is None
    assert json_object_text({"a": "\ud800"}) is None
    assert json_object_text({"a": b"x"}) is None


def test_literal_end_is_undecided_only_inside_the_literal():
    assert literal_end("x[ARGS]{", 1, "[ARGS]") == 7
    assert literal_end("x[AR", 1, "[ARGS]") is INCOMPLETE
    assert literal_end("x", 1, "[ARGS]") is INCOMPLETE
    assert literal_end("x[ARX", 1, "[ARGS]") is INVALID
    assert literal_end("x[ARGX]", 1, "[ARGS]") is INVALID


def test_skip_space_stops_at_the_first_other_character():
    assert skip_space("a \t\n\u3000b", 1) == 5
    assert skip_space("  ", 0) == 2
