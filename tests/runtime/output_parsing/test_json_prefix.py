"""The JSON prefix scanner (``tool_call_formats/json_prefix.py``): complete values end where
``json.loads`` says, their members' spans are their own text, every proper prefix is
undecided, and a definite answer never changes as the text grows."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.runtime.output_parsing.block_parser import INCOMPLETE, INVALID, Undecided
from radixlm.runtime.output_parsing.tool_call_formats.json_prefix import (
    JsonScan,
    JsonScans,
    JsonSpan,
    scan_json,
)

SCALARS = st.none() | st.booleans() | st.integers() | st.text(max_size=8) | st.floats(
    allow_nan=False, allow_infinity=False)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=6), inner, max_size=4), max_leaves=12)
CONTAINERS = st.lists(VALUES, max_size=4) | st.dictionaries(st.text(max_size=6), VALUES,
                                                             max_size=4)
LAYOUTS = st.sampled_from([{}, {"indent": 2}, {"separators": (",", ":")},
                           {"ensure_ascii": False}])


@settings(max_examples=300, deadline=None)
@given(CONTAINERS, LAYOUTS, st.text(max_size=6))
def test_a_complete_value_ends_where_json_says_and_its_prefixes_are_undecided(
        value, layout, tail):
    written = json.dumps(value, **layout)
    span = scan_json(written + tail, 0)
    assert isinstance(span, JsonSpan) and span.end == len(written)
    for key, start, end in span.members:
        member = json.loads(written[start:end])
        assert member == (value[key] if isinstance(value, dict) else member)
    if isinstance(value, list):
        assert [json.loads(written[a:b]) for _, a, b in span.members] == value
    for cut in range(len(written)):
        assert scan_json(written[:cut], 0) is INCOMPLETE, written[:cut]


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet='{}[]",:01-.eE tfrunalsx\\', max_size=24))
def test_answers_agree_with_json_and_never_change_as_the_text_grows(text):
    answer = scan_json(text, 0)
    if isinstance(answer, JsonSpan):
        json.loads(text[:answer.end])
    for cut in range(len(text) + 1):
        earlier = scan_json(text[:cut], 0)
        if earlier is not INCOMPLETE:
            assert earlier == answer, (text[:cut], earlier, answer)
    if answer is INVALID and text[:1] in ("{", "["):  # only containers are scanned
        with pytest.raises(ValueError):
            json.loads(text)


@pytest.mark.parametrize("text", [
    '{"a": NaN}', '{"a": Infinity}', '{"a": 1,}', '[1,]', '{"a": 01}', '{"a": .5}',
    '{"a": 1.}', '{"a": 1e}', '{"a" 1}', "{'a': 1}", '{"a": "tab\there"}', '{"a": "\\x"}',
    '{"a": "\\u12g4"}', '{"a": truex}', '{"a": 1]', '[1}', '"string"', "42", " {}",
])
def test_strict_json_rejects_what_rfc_8259_does(text):
    assert scan_json(text, 0) is INVALID


@pytest.mark.parametrize("text", [
    '{"a": tr', '{"a": -', '{"a": 1.5e+', '{"a": "\\u12', '{"a": "\\', '[', '{"a"', '{"a":',
    '{"a": 12',
])
def test_text_that_could_still_become_json_is_incomplete(text):
    assert scan_json(text, 0) is INCOMPLETE


def test_members_keep_their_own_text_and_the_last_duplicate_wins():
    text = '{"args" : {"b":1,  "a" : [ 1,2 ]}, "x": "}", "args": {"c": true}} tail'
    span = scan_json(text, 0)
    assert isinstance(span, JsonSpan) and text[span.end:] == " tail"
    assert [key for key, _, _ in span.members] == ["args", "x", "args"]
    assert span.member_text(text, "args") == '{"c": true}'
    assert span.member_text(text, "x") == '"}"'
    assert span.member_text(text, "missing") is None


def test_deep_nesting_is_scanned_without_recursion():
    depth = 50_000
    assert scan_json("[" * depth + "]" * depth, 0) == JsonSpan(2 * depth, [(None, 1,
                                                                           2 * depth - 1)])
    assert scan_json("[" * depth, 0) is INCOMPLETE


@settings(max_examples=300, deadline=None)
@given(CONTAINERS, LAYOUTS, st.lists(st.integers(0, 10_000), max_size=6),
       st.text(alphabet='{}[]",:01\\u tx', max_size=6))
def test_a_scan_taken_up_again_answers_as_a_fresh_one(value, layout, points, tail):
    """JsonScan goes on from where its text ran out; JsonScans finds it for the longer text,
    wherever in the text the value now begins."""
    text = json.dumps(value, **layout) + tail
    cuts = sorted({p % (len(text) + 1) for p in points} | {len(text)})
    scan, scans = JsonScan(), JsonScans(size=2)
    for cut in cuts:
        fresh = scan_json(text[:cut], 0)
        assert scan.advance(text[:cut], 0) == fresh
        pad = 4 * (cut % 3)
        assert scans.scan("pad " * (cut % 3) + text[:cut], pad) == moved(fresh, pad)
        if fresh is not INCOMPLETE:
            break


def moved(answer: JsonSpan | Undecided, by: int) -> JsonSpan | Undecided:
    """``answer`` for the same value ``by`` characters further into the text."""
    if not isinstance(answer, JsonSpan):
        return answer
    return JsonSpan(answer.end + by, [(key, a + by, b + by) for key, a, b in answer.members])


def test_scans_of_different_texts_do_not_mix():
    scans = JsonScans(size=2)
    assert scans.scan('{"a": "x', 0) is INCOMPLETE
    assert scans.scan('[1, 2', 0) is INCOMPLETE
    assert scans.scan('{"a": "xy"}', 0) == JsonSpan(11, [("a", 6, 10)])
    assert scans.scan('[1, 2]', 0) == JsonSpan(6, [(None, 1, 2), (None, 4, 5)])
    assert scans.scan('{"a": "x\x01"}', 0) is INVALID  # the same start, then a control char
    assert scans.scan('[1, 2x', 0) is INVALID


def test_an_object_scan_refuses_an_array_at_once():
    scans = JsonScans()
    assert scans.scan_object("[1]", 0) is INVALID
    assert scans.scan_object("x", 0) is INVALID
    assert scans.scan_object("a", 1) is INCOMPLETE
    assert scans.scan_object('{"a": [1]}', 0) == scan_json('{"a": [1]}', 0)
