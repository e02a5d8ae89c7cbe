"""The linear-time stop regex engine against Python's ``re``, on every way of chunking a text."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.runtime.detokenizer import stop_regex
from radixlm.runtime.detokenizer.regex_parser import parse_stop_regex
from radixlm.runtime.detokenizer.stop_regex import (
    MAX_PROGRAM_SIZE,
    StopRegexProgram,
    char_predicate,
    compile_stop_regex,
    fold,
)

ATOMS = ["a", "b", "c", "A", "1", " ", "\\n", ".", "[ab]", "[^a]", "[a-c]", "[A-B]", "[^b-c1]",
         r"\d", r"\w", r"\s", r"\W", r"\D", r"\S", "[\\d_]", "[^\\s]", "(?i:a)", "(?-i:b)", "()",
         "(?:^|a)", r"(?:\A|b)"]
QUANTIFIERS = ["*", "+", "?", "*?", "+?", "??", "{2}", "{1,3}", "{0,2}?", "{2,}", "{,2}"]
TEXT_ALPHABET = "abcAB1 \n_"


def _extend(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.one_of(
        st.tuples(inner, inner).map("".join),
        st.tuples(inner, inner).map(lambda p: f"(?:{p[0]}|{p[1]})"),
        inner.map(lambda p: f"({p})"),
        st.tuples(inner, st.sampled_from(QUANTIFIERS)).map(lambda p: f"(?:{p[0]}){p[1]}"),
    )


patterns = st.tuples(
    st.sampled_from(["", "(?i)", "(?s)", "(?m)", "(?a)", "(?ia)", "(?ims)"]),
    st.recursive(st.sampled_from(ATOMS), _extend, max_leaves=6),
).map("".join)


@st.composite
def pattern_and_text(draw: st.DrawFn) -> tuple[str, str]:
    """A pattern and a short text that, more often than chance, holds a match of it."""
    pattern = draw(patterns)
    matching = st.from_regex(pattern, fullmatch=True, alphabet=TEXT_ALPHABET)
    around = st.text(alphabet=TEXT_ALPHABET, max_size=4)
    return pattern, draw(around) + draw(matching)[:10] + draw(around)


def reference(pattern: str, chunks: list[str]) -> tuple[int, tuple[int, int]] | None:
    """(chunk index, (start, end)) of the first chunk in which a non-empty ``re`` full
    match ends: the leftmost-starting such match, ties to the earliest end."""
    regex = re.compile(pattern)
    text = "".join(chunks)
    begin = 0
    for index, chunk in enumerate(chunks):
        end = begin + len(chunk)
        found = [(s, e) for e in range(begin + 1, end + 1) for s in range(e)
                 if regex.fullmatch(text, s, e)]
        if found:
            return index, min(found)
        begin = end
    return None


def feed_in_chunks(pattern: str, chunks: list[str]) -> tuple[int, tuple[int, int]] | None:
    cursor = compile_stop_regex(pattern).cursor()
    for index, chunk in enumerate(chunks):
        found = cursor.feed(chunk)
        if found is not None:
            return index, found
    return None


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted({c % (len(text) + 1) for c in cuts}), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=400, deadline=None)
@given(pattern_and_text())
def test_fed_one_character_at_a_time_it_finds_the_first_ending_match_re_finds(case):
    pattern, text = case
    assert feed_in_chunks(pattern, list(text)) == reference(pattern, list(text))


@settings(max_examples=300, deadline=None)
@given(pattern_and_text(), st.lists(st.integers(min_value=0, max_value=13), max_size=4))
def test_any_chunking_gives_the_leftmost_match_ending_in_the_first_matching_chunk(case, cuts):
    pattern, text = case
    chunks = split(text, cuts)
    assert feed_in_chunks(pattern, chunks) == reference(pattern, chunks)


@settings(max_examples=200, deadline=None)
@given(patterns)
def test_the_size_counted_before_compiling_is_the_size_compiled(pattern):
    parsed = parse_stop_regex(pattern)
    assert len(compile_stop_regex(pattern).ops) == stop_regex._size(parsed.items) + 1


@pytest.mark.parametrize("pattern", [
    r"\d", r"\D", r"\w", r"\W", r"\s", r"\S", r"(?a)\w", r"(?a)\d", r"(?a)\s", ".", "(?s).",
    "[^a-z0-9]", "(?i)[a-z]", "(?i)[^k]", "(?i)s", "(?i)[\\w-]", "(?ia)[a-z]", "(?ia)k",
    "(?i)[A-Z]", "(?i)[À-ÿ]", "(?i)[Α-Ω]", "(?i)Σ", "(?i)ǅ", "(?i)[^\\W\\d]", "(?i)[Ā-ſ]",
    "(?i)[ǅ-ǅx]", "(?i)[ἀ-ῼ]", "(?i)[\u0345-\u0346]", "(?i)[Ѐ-я]", "(?i)[Ａ-ｚ]",
    "(?i)[\u0400-\u0600]", "(?i)[^A-\u0400]",  # ranges too long to keep as sets of folds
])
def test_a_character_test_agrees_with_re_on_every_bmp_character(pattern):
    parsed = parse_stop_regex(pattern)
    [node] = parsed.items
    test = char_predicate(node, parsed.flags)
    regex = re.compile(pattern)
    wrong = [ch for ch in map(chr, range(0x10000))
             if test(ch) != bool(regex.fullmatch(ch))]
    assert wrong == []


def test_fold_joins_exactly_the_characters_re_joins_under_ignorecase():
    """Every cased character's simple lower/upper/title forms are equal to it under ``re``'s
    IGNORECASE exactly when their folds are equal."""
    mismatched = []
    for point in range(0x110000):
        ch = chr(point)
        forms = {ch.lower(), ch.upper(), ch.title(), fold(ch)}
        forms = {form for form in forms if len(form) == 1 and form != ch}
        if not forms:
            continue
        regex = re.compile("(?i)" + re.escape(ch))
        mismatched += [(ch, form) for form in forms
                       if bool(regex.fullmatch(form)) != (fold(ch) == fold(form))]
    assert mismatched == []


def test_catastrophic_backtracking_patterns_cost_linear_steps():
    program = compile_stop_regex("(.+)+X")
    cursor = program.cursor()
    for _ in range(10_000):
        assert cursor.feed("a") is None
    assert cursor.steps <= 10_000 * (2 * len(program.ops) + 1)
    assert cursor.feed("X") == (0, 10_001)


def test_feeding_at_once_or_per_character_costs_the_same_steps():
    text = "ab" * 500 + "c"
    whole, single = (compile_stop_regex("(a|ab)*c").cursor() for _ in range(2))
    assert whole.feed(text) == (0, len(text))
    found = [single.feed(ch) for ch in text]
    assert found[-1] == (0, len(text)) and found[:-1] == [None] * (len(text) - 1)
    assert whole.steps == single.steps


@pytest.mark.parametrize(("pattern", "named"), [
    (r"(a)\1", "backreference"),
    ("(?P<x>a)(?P=x)", "backreference"),
    ("a(?=b)", "lookahead"),
    ("(?<=a)b", "lookbehind"),
    ("(?!a)b", "negative lookahead"),
    ("(a)(?(1)b|c)", "conditional"),
    ("(?>ab)", "atomic group"),
    ("a*+b", "possessive"),
    ("a$", "$"),
    (r"a\Z", r"\Z"),
    (r"\bword", r"\b"),
    (r"a\Bb", r"\B"),
])
def test_an_unsupported_construct_is_refused_by_name(pattern, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        compile_stop_regex(pattern)


@pytest.mark.parametrize("pattern", ["(unclosed", "[a-", "a**", "(?L)a", "x{2,1}"])
def test_an_invalid_pattern_is_refused_with_re_s_message(pattern):
    with pytest.raises(ValueError, match="not a valid regular expression"):
        compile_stop_regex(pattern)


@pytest.mark.parametrize("pattern", ["(?:a{1000}){1000}", "((a{100}){100}){100}",
                                     "x{2001}", "(?:ab|cd){700}"])
def test_a_pattern_over_the_size_cap_is_refused_before_anything_is_built(pattern, monkeypatch):
    monkeypatch.setattr(StopRegexProgram, "emit", lambda *args: pytest.fail("expanded"))
    with pytest.raises(ValueError, match=f"more than the {MAX_PROGRAM_SIZE} allowed"):
        compile_stop_regex.__wrapped__(pattern)


def test_a_repeat_of_nothing_costs_nothing_however_large_its_count():
    assert len(compile_stop_regex("(){4000000000}x").ops) == 2


@pytest.mark.parametrize(("pattern", "text", "expected"), [
    ("x*", "aaxx", (2, 3)),  # re.search finds the empty match at 0; empty matches never count
    (r"\d+", "ab 123", (3, 4)),  # the earliest end, not the longest
    ("^ab", "xab", None),
    ("(?m)^ab", "x\nab", (2, 4)),
    (r"\Aab", "ab", (0, 2)),
    ("(?i)straße", "STRASSE strAße", (8, 14)),
    (".x", "\nx", None),
    ("(?s).x", "\nx", (0, 2)),
])
def test_the_match_reported_for_one_chunk(pattern, text, expected):
    assert compile_stop_regex(pattern).cursor().feed(text) == expected
