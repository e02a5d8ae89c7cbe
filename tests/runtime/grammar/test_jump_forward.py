"""Jump-forward tokens over the tiny tokenizer and real xgrammar matchers: the sampled
token stays, the forced text follows as the tokenizer splits it (together with the sampled
token where that keeps it), the matcher ends exactly after the returned tokens, and nothing
changes when there is nothing to jump or the tokens do not fit."""

from __future__ import annotations

import json

import pytest
from tiny_models import tiny_tokenizer

from radixlm.runtime.grammar.constraints import GrammarKey
from radixlm.runtime.grammar.jump_forward import JumpForward, extendable_mask

EOS = 0
SCHEMA = json.dumps({
    "type": "object",
    "properties": {"name": {"type": "string"}, "capital": {"type": "string"}},
    "required": ["name", "capital"],
})


@pytest.fixture(scope="module")
def jump():
    return JumpForward(tiny_tokenizer())


def matcher_after(backend, kind: str, text: str, accepted: list[int]):
    matcher = backend.new_matcher(backend.compile(GrammarKey(kind, text)).result())
    for token in accepted:
        assert matcher.accept_token(token)
    return matcher


def state(backend, matcher) -> tuple:
    """What a matcher's position shows: its forced text and its mask."""
    bitmask = backend.bitmask(1).clone()
    matcher.fill_bitmask(bitmask, 0)
    return matcher.jump_forward_string(), matcher.is_completed(), bitmask.tolist()


def test_a_fixed_key_is_appended_as_the_tokenizer_splits_it(backend, jump):
    tokenizer = tiny_tokenizer()
    brace = tokenizer.encode("{")[0]
    matcher = matcher_after(backend, "json_schema", SCHEMA, [brace])
    tokens = jump.jump(matcher, brace, limit=100)
    assert tokenizer.decode(tokens) == '{"name": "'
    assert tokens == tokenizer.encode('{"name": "')
    reference = matcher_after(backend, "json_schema", SCHEMA, tokens)
    assert state(backend, matcher) == state(backend, reference)


def test_the_sampled_token_is_kept_where_the_tokenizer_would_merge_it(backend, jump):
    """"P" + "aris..." would re-tokenize as "Paris": the model chose "P", so it stays and
    the forced text is split on its own."""
    tokenizer = tiny_tokenizer()
    sentence = "Paris is the capital of France"
    first = tokenizer.encode("P")[0]
    assert tokenizer.encode(sentence)[0] != first
    matcher = matcher_after(backend, "regex", sentence, [first])
    tokens = jump.jump(matcher, first, limit=100)
    assert tokens == [first] + tokenizer.encode(sentence[1:])
    assert matcher.is_completed() and matcher.accept_token(EOS)


def test_a_last_token_that_may_grow_is_left_for_the_model(backend, jump):
    tokenizer = tiny_tokenizer()
    grammar = "the cap(ital|s)"  # forced: "the cap"; "Ġcap" is a prefix of "Ġcapital"
    first = tokenizer.encode("t")[0]
    matcher = matcher_after(backend, "regex", grammar, [first])
    tokens = jump.jump(matcher, first, limit=100)
    assert tokenizer.decode(tokens) == "the"
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode(" cap")) == ["Ġcap"]
    assert matcher.jump_forward_string() == " cap"


def test_the_limit_caps_the_tokens_and_below_two_nothing_is_jumped(backend, jump):
    tokenizer = tiny_tokenizer()
    brace = tokenizer.encode("{")[0]
    matcher = matcher_after(backend, "json_schema", SCHEMA, [brace])
    tokens = jump.jump(matcher, brace, limit=3)
    assert tokens == tokenizer.encode('{"name": "')[:3]
    untouched = matcher_after(backend, "json_schema", SCHEMA, [brace])
    before = state(backend, untouched)
    assert jump.jump(untouched, brace, limit=1) is None
    assert state(backend, untouched) == before


def test_nothing_is_jumped_where_the_grammar_leaves_a_choice(backend, jump):
    tokenizer = tiny_tokenizer()
    digit = tokenizer.encode("4")[0]
    matcher = matcher_after(backend, "regex", "[0-9]+(px|em)", [digit])
    before = state(backend, matcher)
    assert jump.jump(matcher, digit, limit=100) is None
    assert state(backend, matcher) == before


def test_tokens_the_grammar_refuses_leave_the_matcher_as_it_was(backend, jump):
    """The forced text spells a special token, which the tokenizer encodes as that token and
    the grammar refuses (special tokens are never grammar text)."""
    tokenizer = tiny_tokenizer()
    first = tokenizer.encode("x")[0]
    matcher = matcher_after(backend, "regex", r"x<\|endoftext\|>y", [first])
    assert EOS in tokenizer.encode("x<|endoftext|>y")
    before = state(backend, matcher)
    assert jump.jump(matcher, first, limit=100) is None
    assert state(backend, matcher) == before


def test_a_sampled_token_ending_a_split_character_is_kept_and_the_forced_text_follows(
    backend, jump
):
    """ü is two byte tokens here; the second alone does not decode to text, so it cannot be
    re-tokenized with what follows: it stays, and the forced text is tokenized after it."""
    tokenizer = tiny_tokenizer()
    first, second = tokenizer.encode("ü")
    assert "\ufffd" in tokenizer.decode([second])
    matcher = matcher_after(backend, "regex", "ü!!!", [first, second])
    tokens = jump.jump(matcher, second, limit=100)
    assert tokens[0] == second and tokens[1:] == tokenizer.encode("!!!")
    assert tokenizer.decode([first, *tokens]) == "ü!!!"
    assert matcher.is_completed()


def test_extendable_tokens_are_those_whose_string_starts_another():
    """The sorted-neighbour rule against the definition, on a hand vocabulary (a gap in its
    ids, prefixes separated in sort order by other pieces) and the tiny tokenizer's."""
    vocab = {"a": 0, "ab": 1, "abc": 2, "b": 3, "a!": 5, "ba": 7, "c": 8, "\u0120x": 9,
             "\u0120": 10}
    mask = extendable_mask(vocab)
    assert len(mask) == 11
    assert [i for i in range(11) if mask[i]] == [0, 1, 3, 10]
    tokenizer = tiny_tokenizer()
    vocab = tokenizer.get_vocab()
    jump = JumpForward(tokenizer)
    expected = {i for piece, i in vocab.items()
                if any(other != piece and other.startswith(piece) for other in vocab)}
    assert expected and expected != set(vocab.values())
    assert {i for i in range(len(vocab) + 5) if jump.is_extendable(i)} == expected
