"""IncrementalDetokenizer and StopMatcher over the tiny byte-level BPE tokenizer."""

from __future__ import annotations

import pytest
from tiny_models import tiny_tokenizer

from radixlm.runtime.detokenizer.incremental_detokenizer import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
)
from radixlm.runtime.detokenizer.stop_matcher import StopMatcher

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Héllo wörld 😀",
    "ünïcödé and emoji 😀😀 are bytes too.",
    "日本語のテキスト",  # characters the tokenizer never saw: one byte per token
    "a",
]
PROMPTS = ["", "Paris is the capital of", "é"]


def feed_one_at_a_time(ids: list[int], prompt_ids: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tiny_tokenizer(), prompt_ids)
    pieces = [detokenizer.feed([token]) for token in ids]
    pieces.append(detokenizer.finish())
    assert detokenizer.text == "".join(pieces)
    return pieces


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("text", TEXTS)
def test_pieces_fed_one_token_at_a_time_concatenate_to_the_full_decode(text, prompt):
    tokenizer = tiny_tokenizer()
    ids = tokenizer.encode(text)
    pieces = feed_one_at_a_time(ids, tokenizer.encode(prompt))
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)


def test_multi_byte_characters_really_span_several_tokens():
    """Guards the test above: the emoji must be split across tokens to exercise the hold-back."""
    tokenizer = tiny_tokenizer()
    ids = tokenizer.encode("Héllo wörld 😀")
    assert any(REPLACEMENT_CHAR in tokenizer.decode([t]) for t in ids)


def test_an_incomplete_character_is_held_back_until_completed():
    tokenizer = tiny_tokenizer()
    ids = tokenizer.encode("😀")
    assert len(ids) > 1
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    assert [detokenizer.feed([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detokenizer.feed(ids[-1:]) == "😀"


def test_finish_flushes_an_incomplete_character_as_replacement():
    tokenizer = tiny_tokenizer()
    ids = tokenizer.encode("ok😀")
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    emitted = "".join(detokenizer.feed([t]) for t in ids[:-1])
    assert emitted == "ok"
    assert detokenizer.finish().endswith(REPLACEMENT_CHAR)


@pytest.mark.parametrize("chunk", [2, 3, 5])
def test_feeding_several_tokens_at_once_gives_the_same_text(chunk):
    tokenizer = tiny_tokenizer()
    text = "Héllo wörld 😀 and the quick brown fox"
    ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    for start in range(0, len(ids), chunk):
        detokenizer.feed(ids[start : start + chunk])
    detokenizer.finish()
    assert detokenizer.text == text


def test_special_tokens_are_skipped_by_default_and_kept_on_request():
    tokenizer = tiny_tokenizer()
    ids = tokenizer.encode("The fox") + [tokenizer.eos_token_id] + tokenizer.encode(" ran")
    skipped = IncrementalDetokenizer(tokenizer, [])
    kept = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    for token in ids:
        skipped.feed([token])
        kept.feed([token])
    assert skipped.text == "The fox ran"
    assert "<|endoftext|>" in kept.text


def search_in_chunks(matcher: StopMatcher, chunks: list[str]):
    """Feeds a growing text chunk by chunk; returns (chunk index, match) of the first match."""
    text = ""
    for index, chunk in enumerate(chunks):
        text += chunk
        found = matcher.search(text, len(chunk))
        if found is not None:
            return index, found
    return None


@pytest.mark.parametrize(
    ("stops", "chunks", "expected"),
    [
        (["STOP"], ["abc ST", "O", "P tail"], (2, (4, 8, "STOP"))),
        (["STOP"], ["S", "T", "O", "P"], (3, (0, 4, "STOP"))),
        (["STOP"], ["xxSTOPyy"], (0, (2, 6, "STOP"))),
        (["STOP"], ["ST", "OX", "STOP"], (2, (4, 8, "STOP"))),
        (["end", "nd!"], ["the e", "nd!"], (1, (4, 7, "end"))),
        (["b", "abc"], ["xa", "bc"], (1, (1, 4, "abc"))),  # the earliest start wins
        (["STOP"], ["no", " match", " here"], None),
    ],
)
def test_stop_string_is_found_across_chunk_boundaries(stops, chunks, expected):
    assert search_in_chunks(StopMatcher(stops, []), chunks) == expected


@pytest.mark.parametrize(
    ("regexes", "chunks", "expected"),
    [
        ([r"\d{3}"], ["ab 1", "2", "3 c"], (2, (3, 6, "123"))),
        ([r"END\."], ["the E", "ND", "."], (2, (4, 8, "END."))),
        ([r"x+y"], ["aaa"], None),
    ],
)
def test_stop_regex_is_found_across_chunk_boundaries(regexes, chunks, expected):
    assert search_in_chunks(StopMatcher([], regexes), chunks) == expected


@pytest.mark.parametrize(
    ("stops", "text", "held"),
    [
        (["STOP"], "hello S", 1),
        (["STOP"], "hello ST", 2),
        (["STOP"], "hello STO", 3),
        (["STOP"], "hello", 0),
        (["STOP"], "hello SX", 0),
        (["STOP"], "", 0),
        (["STOP", "OPEN"], "xx OP", 2),
        (["ab", "abcd"], "zzabc", 3),
        (["\n\n"], "line\n", 1),
    ],
)
def test_held_back_is_the_length_of_a_partial_stop_suffix(stops, text, held):
    assert StopMatcher(stops, []).held_back(text) == held
