"""The Aho–Corasick stop string automaton and StopMatcher against naive loops."""

from __future__ import annotations

import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.runtime.detokenizer.stop_matcher import StopMatcher
from radixlm.runtime.detokenizer.stop_strings import StopStringAutomaton, stop_string_automaton

stop_lists = st.lists(st.text(alphabet="abc", min_size=1, max_size=5), min_size=1, max_size=6)
texts = st.text(alphabet="abcd", max_size=20)
cut_lists = st.lists(st.integers(min_value=0, max_value=20), max_size=5)


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted({c % (len(text) + 1) for c in cuts}), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def naive_search(stops: list[str], text: str, begin: int) -> tuple[int, int, str] | None:
    """The leftmost-starting stop string ending in ``text[begin:]``, ties to the earliest end."""
    found = [(e - len(s), e, s) for e in range(begin + 1, len(text) + 1) for s in stops
             if text[:e].endswith(s)]
    return min(found, key=lambda m: m[:2], default=None)


def naive_held(stops: list[str], text: str) -> int:
    """The longest suffix of ``text`` that is a proper prefix of a stop string."""
    return max((k for k in range(1, len(text) + 1)
                if any(len(s) > k and s.startswith(text[-k:]) for s in stops)), default=0)


@settings(max_examples=300, deadline=None)
@given(stop_lists, texts, cut_lists)
def test_each_chunk_reports_the_leftmost_stop_ending_in_it_and_the_partial_stop_held(
        stops, text, cuts):
    cursor = StopStringAutomaton(tuple(stops)).cursor()
    fed = ""
    for chunk in split(text, cuts):
        found = cursor.feed(chunk)
        assert found == naive_search(stops, fed + chunk, len(fed))
        fed += chunk
        assert cursor.held == naive_held(stops, fed)
    assert cursor.steps <= 2 * len(text)


def naive_regex_matches(patterns: list[str], text: str, begin: int) -> list[tuple[int, int, str]]:
    return [(s, e, text[s:e]) for pattern in patterns for e in range(begin + 1, len(text) + 1)
            for s in range(e) if re.fullmatch(pattern, text[s:e])]


@settings(max_examples=300, deadline=None)
@given(stop_lists, st.lists(st.text(alphabet="ab1", min_size=1, max_size=3), max_size=3),
       texts, cut_lists)
def test_search_takes_the_earliest_start_across_stop_strings_and_regexes(
        stops, literals, text, cuts):
    """Ties: the earliest end, then stop strings before regexes, then the regex listed first."""
    patterns = [re.escape(literal) + "+" for literal in literals]
    matcher = StopMatcher(stops, patterns)
    fed = ""
    for chunk in split(text, cuts):
        begin, fed = len(fed), fed + chunk
        strings = naive_search(stops, fed, begin)
        candidates = ([strings] if strings else []) + naive_regex_matches(patterns, fed, begin)
        expected = min(candidates, key=lambda m: m[:2], default=None)
        assert matcher.search(fed, len(chunk)) == expected
        if expected is not None:
            break


@settings(max_examples=200, deadline=None)
@given(stop_lists, texts, cut_lists)
def test_held_back_reads_only_what_it_has_not_read(stops, text, cuts):
    matcher = StopMatcher(stops, [])
    fed = ""
    for chunk in split(text, cuts):
        fed += chunk
        assert matcher.held_back(fed) == naive_held(stops, fed)
    assert matcher.steps <= 2 * len(text)


@pytest.mark.parametrize(("stops", "text", "held"), [
    (["ab", "xyzw"], "qab", 0),  # a whole stop string is no longer a partial one
    (["ab", "abcd"], "zzab", 2),  # ...unless it also starts a longer one
    (["aab"], "aaaa", 2),
    (["abab", "bac"], "xaba", 3),
    (["a", "a"], "a", 0),
])
def test_held_back_holds_only_proper_prefixes_of_stop_strings(stops, text, held):
    assert StopMatcher(stops, []).held_back(text) == held


def test_a_repeated_stop_string_reports_its_text():
    assert StopStringAutomaton(("ab", "ab", "b")).cursor().feed("xab") == (1, 3, "ab")


def test_an_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match="non-empty"):
        StopStringAutomaton(("ok", ""))


def test_requests_with_the_same_stop_list_share_one_automaton():
    assert stop_string_automaton(("a", "b")) is stop_string_automaton(("a", "b"))


def test_ten_thousand_long_stop_strings_cost_per_character_not_per_stop():
    stops = ["x" * 490 + f"{i:010d}" for i in range(10_000)]
    searcher, holder = StopMatcher(stops, []), StopMatcher(stops, [])
    text = ""
    for ch in "x" * 1_990:
        text += ch
        assert searcher.search(text, 1) is None
        assert holder.held_back(text) == min(len(text), 490)
    for ch in "0000000042":
        text += ch
        found = searcher.search(text, 1)
    assert found == (len(text) - 500, len(text), stops[42])
    assert searcher.steps <= 2 * len(text) and holder.steps <= 2 * len(text)


def test_random_long_stop_strings_cost_at_most_two_steps_per_character():
    rng = random.Random(0)
    stops = ["".join(rng.choice("ab") for _ in range(500)) for _ in range(200)]
    cursor = StopStringAutomaton(tuple(stops)).cursor()
    text = "".join(rng.choice("ab") for _ in range(2_000)) + stops[7]
    first_end = min(text.find(stop) + len(stop) for stop in stops if stop in text)
    found = [cursor.feed(ch) for ch in text]
    assert found.index(next(f for f in found if f is not None)) == first_end - 1
    assert cursor.steps <= 2 * len(text)
