"""The stop-regex parser against ``re``: the same patterns valid, the same matches, and the
constructs a linear-time engine cannot run refused by name."""

from __future__ import annotations

import re
import sys
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.runtime.detokenizer.regex_parser import parse_stop_regex
from radixlm.runtime.detokenizer.stop_regex import compile_stop_regex

needs_311_syntax = pytest.mark.skipif(
    sys.version_info < (3, 11), reason="the parser follows Python 3.11's re syntax")

TEXTS = ["", "a", "ab", "aab", "ba", "A b\n", "{ab}", "-]a", "\x08a", "a\nb", "abab", "Aa_1"]

# Pieces of patterns, valid and not, that exercise every branch of the parser.
TOKENS = ["a", "b", "A", " ", "\n", "-", ",", "1", "2", "_", ".", "^", "$", "|", "(", ")",
          "[", "]", "[^", "*", "+", "?", "{", "}", "{1}", "{,2}", "{1,}", "{2,1}", "(?:",
          "(?i)", "(?x)", "(?s)", "(?m)", "(?a)", "(?u)", "(?i:", "(?-i:", "(?x:", "(?#c)",
          "(?P<n>", "(?P=n)", "(?=", "(?!", "(?<=", "(?<!", "(?(1)", "(?>", "#", "\\",
          "\\d", "\\W", "\\s", "\\b", "\\B", "\\A", "\\Z", "\\1", "\\0", "\\12", "\\101",
          "\\x4", "\\x41", "\\u0062", "\\N{LATIN SMALL LETTER A}", "\\q", "\\-", "\\]",
          "\\{", "\\ ", "\\#"]
UNSUPPORTED_MARKERS = ["$", "\\b", "\\B", "\\Z", "(?=", "(?!", "(?<", "(?P=", "(?(",
                       "(?>", "*+", "++", "?+", "}+", *(f"\\{d}" for d in range(1, 10))]


def re_accepts(pattern: str) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # re warns of possible nested sets
        try:
            re.compile(pattern)
        except (re.error, OverflowError, ValueError):
            return False
    return True


def matches(pattern: str, text: str) -> list[tuple[int, int]]:
    """Every non-empty (start, end) that ``re`` matches in full: what a stop regex counts."""
    regex = re.compile(pattern)
    return [(s, e) for e in range(1, len(text) + 1) for s in range(e)
            if regex.fullmatch(text, s, e)]


def assert_same_matches(pattern: str) -> None:
    for text in TEXTS:
        found = matches(pattern, text)
        expected = min(found) if found else None
        assert compile_stop_regex(pattern).cursor().feed(text) == expected, (pattern, text)


@needs_311_syntax
@settings(max_examples=1500, deadline=None)
@given(st.lists(st.sampled_from(TOKENS), max_size=8).map("".join))
def test_a_random_pattern_is_valid_here_exactly_when_re_accepts_it(pattern):
    valid = re_accepts(pattern)
    try:
        compile_stop_regex.__wrapped__(pattern)
    except ValueError as err:
        refused = "is not supported" in str(err) or "more than the" in str(err)
        assert refused or not valid, (pattern, str(err))
        assert not refused or any(marker in pattern for marker in UNSUPPORTED_MARKERS) \
            or "more than the" in str(err), (pattern, str(err))
        return
    assert valid, pattern
    assert_same_matches(pattern)


@pytest.mark.parametrize("pattern", [
    "(?x) a b  # a comment\n c", "(?x)a[ ]b\\ c", "(?x)a #c\\\nb", "(?x:a b)c d",
    "a{,2}", "a{", "a{1,2", "x{}", "a{,}", "a{x}", "{", "}", "[]a]", "[^]a]", "[a-]", "[-a]",
    "[\\d-]", "[a\\-z]", "\\x41", "\\u0062", "\\U00000061", "\\N{LATIN SMALL LETTER A}",
    "\\141", "\\0", "\\01", "[\\b]", "[\\141]", "\\-", "\\]", "(?P<name>ab)+", "(?#c)a",
    "a(?#c)*", "(?i:A)b", "(?-i:a)", "(?i)(?s)a.", "(?#c)(?i)A", "(?u)a", "(a)|b", "(?:)",
    "a|ab|abc", "ab|ac", "a|b|[c-d]", "(?:a|b)*", "(?i)[a]|B", "()*a", "(?:^)*a", "(?ms).^a",
])
def test_valid_syntax_is_accepted_and_matches_as_re(pattern):
    assert re_accepts(pattern)
    assert_same_matches(pattern)


@needs_311_syntax
@pytest.mark.parametrize("pattern", [
    "a(?i)b", "a|(?i)b", "(?:(?i)a)", "x{2,1}", "[z-a]", "[\\d-z]", "[a-\\w]", "\\q", "[\\A]",
    "[\\8]", "\\", "a)", "(a", "[a", "(?#c", "(?P<1>a)", "(?P<a>x)(?P<a>y)", "(?P<a", "(?Px)",
    "(?au)", "(?a)(?u)", "(?L)a", "(?-a:x)", "(?i-i:x)", "(?i", "(?-", "(?-:a)", "(?q)",
    "(?<x)", "(?", "\\x4", "\\u12", "\\U0011ffff", "\\N{NO SUCH NAME}", "\\N{}", "\\Nx",
    "\\400", "[\\400]", "*a", "^*", "\\A+", "a**", "a*?*", "a{1}{2}", "(?i)*", "a{4294967295}",
])
def test_invalid_syntax_is_refused_as_re_refuses_it(pattern):
    assert not re_accepts(pattern)
    with pytest.raises(ValueError, match="not a valid regular expression"):
        parse_stop_regex(pattern)


@pytest.mark.parametrize(("pattern", "named"), [
    ("(?<!a)b", "negative lookbehind"),
    ("(?P=x)", "backreference"),
    ("a++", "possessive"),
    ("a{1,2}+", "possessive"),
    ("[a]$", "$"),
])
def test_constructs_that_need_more_than_one_pass_are_refused_by_name(pattern, named):
    with pytest.raises(ValueError, match=re.escape(named) + ".* is not supported"):
        parse_stop_regex(pattern)


ATOMS = ["a", "b", ".", "[ab]", "[^a]", r"\w", r"\s", "(?i:A)", "(?s:.)"]


def _extend(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.one_of(
        st.tuples(inner, inner).map("".join),
        st.tuples(inner, inner).map(lambda p: f"(?:{p[0]}|{p[1]})"),
        st.tuples(inner, st.sampled_from(["*", "+", "?", "{2}", "{1,3}?"]))
        .map(lambda p: f"(?:{p[0]}){p[1]}"),
    )


@settings(max_examples=500, deadline=None)
@given(st.recursive(st.sampled_from(ATOMS), _extend, max_leaves=5),
       st.text(alphabet="abAB \n", max_size=12))
def test_a_pattern_that_cannot_match_empty_starts_where_re_search_finds_it(pattern, text):
    """Without anchors, a pattern that cannot match the empty text matches nothing empty,
    so ``re.search`` finds the leftmost match a stop regex reports."""
    if re.fullmatch(pattern, ""):
        return
    found = compile_stop_regex(pattern).cursor().feed(text)
    searched = re.search(pattern, text)
    assert (found and found[0]) == (searched and searched.start())
