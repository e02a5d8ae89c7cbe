"""Checks every tool-call parser's tests share: streaming equals parsing, over every split
of an output (``output_parsing/tool_call_types.py`` states the invariant)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.runtime.output_parsing.tool_call_types import (
    ParsedToolCalls,
    ToolCall,
    ToolCallParser,
)

Corpus = list[tuple[str, str, list[ToolCall]]]
"""Outputs of a format, each with the content and calls it parses to."""


def content_only(text: str) -> tuple[str, str, list[ToolCall]]:
    """A corpus entry for an output with no call: all of it is content, byte for byte."""
    return text, text, []


def streamed(parser: ToolCallParser, pieces: list[str]) -> ParsedToolCalls:
    """What a stream gives for ``pieces`` fed in order, then finished, as one result."""
    stream = parser.stream()
    out = [piece for text in pieces for piece in stream.feed(text)] + stream.finish()
    content = "".join(piece for piece in out if isinstance(piece, str))
    return ParsedToolCalls(content, [piece for piece in out if isinstance(piece, ToolCall)])


def cut(text: str, points: list[int]) -> list[str]:
    """``text`` cut at ``points`` (any order, repeats allowed: empty pieces are fed too)."""
    bounds = [0, *sorted(min(max(p, 0), len(text)) for p in points), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def assert_stream_agrees(parser: ToolCallParser, text: str) -> ParsedToolCalls:
    """Streams ``text`` whole, one character at a time and split at every single point, and
    checks each gives what ``parse`` gives; returns that."""
    whole = parser.parse(text)
    assert streamed(parser, [text]) == whole
    assert streamed(parser, list(text)) == whole, "fed one character at a time"
    for point in range(1, len(text)):
        assert streamed(parser, cut(text, [point])) == whole, f"split at {point}"
    for call in whole.calls:
        assert isinstance(json.loads(call.arguments), dict), call
    return whole


def assert_parses_to(parser: ToolCallParser, text: str, content: str,
                     calls: list[ToolCall]) -> None:
    """``text`` parses to ``content`` and ``calls``, and streams so over every split."""
    parsed = assert_stream_agrees(parser, text)
    assert (parsed.content, parsed.calls) == (content, calls), text


def assert_any_split_agrees(parser: ToolCallParser, corpus: Corpus, examples: int = 200):
    """A property test: any cutting of any text of ``corpus`` streams to ``parse``'s result."""
    texts = [text for text, _, _ in corpus]

    @settings(max_examples=examples, deadline=None)
    @given(st.sampled_from(texts), st.lists(st.integers(0, 10_000), max_size=12))
    def check(text: str, points: list[int]) -> None:
        assert streamed(parser, cut(text, [p % (len(text) + 1) for p in points])) == \
            parser.parse(text)

    check()
