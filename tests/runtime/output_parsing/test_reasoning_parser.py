"""Reasoning parsers: each family splits a corpus of outputs as written out by hand, a stream
gives the same split for any way of cutting the output into pieces, and a stream gives back
text as soon as it is decided."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.runtime.output_parsing.reasoning_parser import (
    REASONING_PARSERS,
    ReasoningParser,
    get_reasoning_parser,
)

PARSERS = [get_reasoning_parser(name) for name in REASONING_PARSERS]

Split = tuple[str | None, str]


@dataclass(frozen=True)
class Case:
    """An output written with placeholders ({S} start tag, {E} end tag, {e} the end tag less
    its last character, {s} the start tag less its last, {T} a tool-call marker) and its
    split when the output starts in content (``opens``) and when it starts in reasoning
    (``forced``; None: the same as ``opens``)."""

    text: str
    opens: Split
    forced: Split | None = None


CORPUS = [
    Case("{S}\nLet me think.\n{E}\n\nThe answer is 42.",
         ("\nLet me think.\n", "The answer is 42.")),
    Case("Let me think.{E}The answer.",
         (None, "Let me think.{E}The answer."), ("Let me think.", "The answer.")),
    Case("The answer is 42.", (None, "The answer is 42."), ("The answer is 42.", "")),
    Case("{S}unclosed thinking", ("unclosed thinking", "")),
    Case("Hi {S}not at the start{E} done",
         (None, "Hi {S}not at the start{E} done"), ("Hi {S}not at the start", " done")),
    Case("  \n{S}after whitespace{E}x", ("after whitespace", "x")),
    Case("", (None, ""), ("", "")),
    Case("{S}{E}", ("", "")),
    Case("{S}a{E}b{E}c", ("a", "b{E}c")),
    Case("{S}a{S}b{E}c", ("a{S}b", "c")),
    Case("{S}a{E}\n\n\n", ("a", "")),
    Case("{S}a{E}\r\n content\n", ("a", " content\n")),
    Case("{S}cut in the end tag {e}", ("cut in the end tag {e}", "")),
    Case("{s}", (None, "{s}"), ("{s}", "")),
    Case("{S}{S}twice", ("{S}twice", "")),
    Case("{S}x{E}", ("x", "")),
    Case("{E}", (None, "{E}"), ("", "")),
    Case("{E}{S}y", (None, "{E}{S}y"), ("", "{S}y")),
    Case("{S}Compute 2+2 = 4.\nCheck: fine.{E}\n\n**4**",
         ("Compute 2+2 = 4.\nCheck: fine.", "**4**")),
    Case("\n\nplain", (None, "\n\nplain"), ("\n\nplain", "")),
    Case("{S}多语言 思考 ✓{E}答案", ("多语言 思考 ✓", "答案")),
    Case("{S}a {e} b{E}c", ("a {e} b", "c")),
    Case("{S}<b>bold</b> and </thin k>{E}<i>ok</i>", ("<b>bold</b> and </thin k>", "<i>ok</i>")),
    Case("{s}x{E}y", (None, "{s}x{E}y"), ("{s}x", "y")),
    Case("   ", (None, "   "), ("   ", "")),
]

TOOL_CORPUS = [  # for families whose tool calls open with ``tool_call_tag``
    Case('{S}I will call it.{T}{"name": "f"}</tool_call>',
         ("I will call it.", '{T}{"name": "f"}</tool_call>')),
    Case("{S}a{E}\n{T}x</tool_call>", ("a", "{T}x</tool_call>")),
    Case("plan{T}x", (None, "plan{T}x"), ("plan", "{T}x")),
    Case("{S}a{T}b{E}c", ("a", "{T}b{E}c")),
    Case("{S}a{E}b{T}c", ("a", "b{T}c")),
]


def fill(text: str | None, parser: ReasoningParser) -> str | None:
    if text is None:
        return None
    return (text.replace("{S}", parser.start_tag).replace("{E}", parser.end_tag)
            .replace("{s}", parser.start_tag[:-1]).replace("{e}", parser.end_tag[:-1])
            .replace("{T}", parser.tool_call_tag or "<tool_call>"))


def expected(case: Case, parser: ReasoningParser) -> Split:
    reasoning, content = case.forced if parser.starts_in_reasoning and case.forced else case.opens
    return fill(reasoning, parser), fill(content, parser)


def corpus_of(parser: ReasoningParser) -> list[Case]:
    return CORPUS + (TOOL_CORPUS if parser.tool_call_tag else [])


def streamed(parser: ReasoningParser, pieces: list[str], thinking: bool = True) -> Split:
    stream = parser.stream(thinking)
    reasoning, content = "", ""
    for piece in pieces:
        r, c = stream.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    reasoning, content = reasoning + r, content + c
    return (reasoning if stream.had_reasoning else None), content


def test_every_sglang_family_with_tags_is_known():
    assert set(REASONING_PARSERS) == {"deepseek-r1", "deepseek-v3", "qwen3", "qwen3-thinking",
                                      "glm45", "kimi", "step3", "minimax"}
    assert [p.name for p in PARSERS] == list(REASONING_PARSERS)


def test_an_unknown_name_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"--reasoning-parser 'gpt-oss' is unknown; known: "
                                         r"deepseek-r1, deepseek-v3, qwen3"):
        get_reasoning_parser("gpt-oss")


@pytest.mark.parametrize(("name", "start", "end", "starts_in_reasoning"), [
    ("deepseek-r1", "<think>", "</think>", True),
    ("deepseek-v3", "<think>", "</think>", True),
    ("qwen3", "<think>", "</think>", False),
    ("qwen3-thinking", "<think>", "</think>", True),
    ("glm45", "<think>", "</think>", False),
    ("kimi", "◁think▷", "◁/think▷", False),
    ("step3", "<think>", "</think>", True),
    ("minimax", "<think>", "</think>", True),
])
def test_each_family_has_its_tags_and_start(name, start, end, starts_in_reasoning):
    parser = get_reasoning_parser(name)
    assert (parser.start_tag, parser.end_tag, parser.starts_in_reasoning) == (
        start, end, starts_in_reasoning)


@pytest.mark.parametrize("parser", PARSERS, ids=REASONING_PARSERS)
def test_each_output_of_the_corpus_splits_as_written(parser):
    cases = corpus_of(parser)
    assert len(cases) >= 20
    for case in cases:
        text = fill(case.text, parser)
        assert parser.split(text) == expected(case, parser), text


@pytest.mark.parametrize("parser", PARSERS, ids=REASONING_PARSERS)
def test_a_stream_of_one_character_pieces_splits_as_written(parser):
    for case in corpus_of(parser):
        text = fill(case.text, parser)
        assert streamed(parser, list(text)) == expected(case, parser), text


@pytest.mark.parametrize("parser", PARSERS, ids=REASONING_PARSERS)
def test_thinking_off_leaves_all_content_where_the_template_honours_it(parser):
    for case in corpus_of(parser):
        text = fill(case.text, parser)
        if parser.thinking_switch is None:  # the family always thinks
            assert parser.split(text, thinking=False) == parser.split(text)
        else:
            assert parser.split(text, thinking=False) == (None, text)
            assert streamed(parser, list(text), thinking=False) == (None, text)


def test_thinking_follows_the_request_template_kwargs():
    qwen3, v3, r1 = (get_reasoning_parser(n) for n in ("qwen3", "deepseek-v3", "deepseek-r1"))
    assert qwen3.thinking_enabled(None) and qwen3.thinking_enabled({"enable_thinking": True})
    assert not qwen3.thinking_enabled({"enable_thinking": False})
    assert not v3.thinking_enabled({}) and v3.thinking_enabled({"thinking": True})
    assert r1.thinking_enabled({"enable_thinking": False, "thinking": False})


def test_a_stream_gives_text_back_as_soon_as_it_is_decided():
    stream = get_reasoning_parser("qwen3").stream()
    steps = [("<th", ("", "")), ("ink>ab", ("ab", "")), ("c</thi", ("c", "")),
             ("nk>\n", ("", "")), ("\nHi <", ("", "Hi <")), ("think>", ("", "think>"))]
    for piece, deltas in steps:
        assert stream.feed(piece) == deltas, piece
    assert stream.finish() == ("", "")


def test_a_stream_holds_only_a_tail_that_could_be_a_tag():
    stream = get_reasoning_parser("deepseek-r1").stream()
    assert stream.feed("so x <") == ("so x ", "")  # "<" may open "</think>"
    assert stream.feed(" y <") == ("< y ", "")  # "< " cannot

    assert stream.feed("</") == ("<", "")
    assert stream.finish() == ("</", "")  # never closed: all reasoning


def test_tags_inside_one_another_are_refused():
    with pytest.raises(ValueError, match="none inside another"):
        ReasoningParser("bad", "<t>", "<t>>", starts_in_reasoning=False)


FRAGMENTS = ["<think>", "</think>", "<tool_call>", "◁think▷", "◁/think▷", "<", "</", "<th",
             "</thi", "◁", "◁/", ">", "\n", "\r\n", " ", "a", "思", "x y"]


@st.composite
def output_and_cuts(draw, parser: ReasoningParser):
    """An output built from tag fragments (or one of the corpus) and places to cut it."""
    if draw(st.booleans()):
        text = fill(draw(st.sampled_from(corpus_of(parser))).text, parser)
    else:
        text = "".join(draw(st.lists(st.sampled_from(FRAGMENTS), max_size=14)))
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("parser", PARSERS, ids=REASONING_PARSERS)
@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "not-thinking"])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_streaming_equals_splitting_for_any_cut(parser, thinking, data):
    text, pieces = data.draw(output_and_cuts(parser))
    assert "".join(pieces) == text
    assert streamed(parser, pieces, thinking) == parser.split(text, thinking)
    reasoning, content = parser.split(text, thinking)
    assert len(reasoning or "") + len(content) <= len(text)  # tags dropped, nothing invented
