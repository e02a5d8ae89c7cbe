"""Reasoning parsers: a model's thinking (``<think>...</think>`` and its kin) split out of a
chat output into ``reasoning_content``, the rest left as ``content``.

A family (``--reasoning-parser NAME``, SGLang's names) has a start tag, an end tag, and says
whether its output begins inside the reasoning (``starts_in_reasoning``: the chat template
opened the thinking in the prompt, as DeepSeek-R1's and Qwen3-Thinking's do). The rules,
one scanner for whole outputs and streams alike (``ReasoningStream``):

- Reasoning begins at the start of the output: with a start tag there (after optional
  whitespace, which is dropped with the tag), or without one for a family that
  ``starts_in_reasoning`` (a leading start tag is still dropped: DeepSeek-R1-0528 writes
  one). A start tag anywhere else is text: for Qwen3, ``"Hi <think>x</think>"`` is all
  content; inside reasoning it is reasoning.
- Reasoning ends at the first end tag (dropped), or, for a family with a
  ``tool_call_tag``, at the first tool-call marker, which is kept as content (Qwen3 and
  GLM-4.5 models sometimes open a tool call without closing their thinking). Content after
  an end tag loses its leading newlines (models write ``</think>\\n\\n``); nothing else is
  stripped, reasoning is kept verbatim.
- An output that never closes its thinking is all reasoning, content empty (what SGLang
  does), a partial end tag at its end included.
- Thinking off (``thinking=False``: the request's ``chat_template_kwargs`` turned the
  family's ``thinking_switch`` off): the template wrote an empty thinking into the prompt,
  the output is all content, verbatim. A family without a switch always thinks and ignores
  ``thinking``.

``split`` returns None for the reasoning when the output had no reasoning section (an empty
one, ``<think></think>``, is ``""``).

Streaming equals splitting: for any split of a text into pieces fed in order, then
``finish()``, the reasoning deltas joined equal ``split``'s reasoning (or "" when None) and
the content deltas joined equal its content. A stream holds back only what is undecided: a
tail that could still grow into a tag, leading whitespace before a possible start tag, and
newlines right after an end tag (tests/runtime/output_parsing check all of it).

Left out: gpt-oss's harmony format (channels, not tags: ``analysis`` vs ``final``), and
SGLang's families with model-specific rules beyond tags (``kimi_k2``, ``minimax-m3``...).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from radixlm.runtime.output_parsing.block_parser import partial_suffix

THINK_START = "<think>"
THINK_END = "</think>"
QWEN_TOOL_CALL = "<tool_call>"


@dataclass(frozen=True)
class ReasoningParser:
    """One family's tags and where its output starts (see the module docstring).

    Invariant (checked when built): no tag is a substring of another, so the first tag
    found in a text is decided as soon as it is complete.
    """

    name: str
    start_tag: str
    end_tag: str
    starts_in_reasoning: bool
    """The template opens the thinking in the prompt: the output begins inside it."""
    thinking_switch: str | None = None
    """The ``chat_template_kwargs`` key that turns the thinking on or off (``enable_thinking``
    for Qwen3); None: the family always thinks."""
    thinking_default: bool = True
    """Whether a request that does not set ``thinking_switch`` thinks."""
    tool_call_tag: str | None = None
    """A tool call's opening marker that also ends the reasoning (kept as content)."""

    def __post_init__(self) -> None:
        tags = [t for t in (self.start_tag, self.end_tag, self.tool_call_tag) if t is not None]
        if not all(tags) or any(a in b for a in tags for b in tags if a is not b):
            raise ValueError(f"reasoning parser {self.name!r}: tags must be non-empty and "
                             f"none inside another, got {tags}")

    @property
    def _closing_tags(self) -> tuple[str, ...]:
        if self.tool_call_tag is None:
            return (self.end_tag,)
        return (self.end_tag, self.tool_call_tag)

    def thinking_enabled(self, chat_template_kwargs: Mapping[str, Any] | None) -> bool:
        """Whether a request with these ``chat_template_kwargs`` thinks (the ``thinking``
        argument of ``split`` and ``stream``)."""
        if self.thinking_switch is None:
            return True
        value = (chat_template_kwargs or {}).get(self.thinking_switch)
        return self.thinking_default if value is None else bool(value)

    def split(self, text: str, thinking: bool = True) -> tuple[str | None, str]:
        """(reasoning, or None if the output had none; content) of a whole output."""
        stream = self.stream(thinking)
        reasoning, content = stream.feed(text)
        last_reasoning, last_content = stream.finish()
        if not stream.had_reasoning:
            return None, content + last_content
        return reasoning + last_reasoning, content + last_content

    def stream(self, thinking: bool = True) -> ReasoningStream:
        """A scanner for one output arriving in pieces."""
        return ReasoningStream(self, thinking or self.thinking_switch is None)

    def _first_closing(self, text: str) -> tuple[int, str] | None:
        """Where the first end tag or tool-call marker in ``text`` begins, and which."""
        found = [(at, tag) for tag in self._closing_tags if (at := text.find(tag)) >= 0]
        return min(found) if found else None


_OPENING = "opening"  # at the start: a start tag may still come
_REASONING = "reasoning"
_AFTER_END = "after_end"  # just past an end tag: leading newlines are dropped
_CONTENT = "content"


class ReasoningStream:
    """Incremental splitting of one output (see the module docstring for what it holds)."""

    def __init__(self, parser: ReasoningParser, thinking: bool):
        self._parser = parser
        self._state = _OPENING if thinking else _CONTENT
        self._pending = ""  # the undecided text
        self.had_reasoning = False
        """Whether the output has a reasoning section (so far; final after ``finish``)."""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning delta, content delta) that ``text`` and what was held back decide."""
        self._pending += text
        return self._scan(final=False)

    def finish(self) -> tuple[str, str]:
        """What was held back, decided now that the output has ended."""
        return self._scan(final=True)

    def _scan(self, final: bool) -> tuple[str, str]:
        parser = self._parser
        reasoning, content = "", ""
        text = self._pending
        while text or final:
            state = self._state
            if state == _OPENING:
                body = text.lstrip()
                if body.startswith(parser.start_tag):
                    text = body[len(parser.start_tag):]
                    self._enter_reasoning()
                    continue
                if not final and parser.start_tag.startswith(body):
                    break  # whitespace, or a start tag still arriving
                if parser.starts_in_reasoning:
                    self._enter_reasoning()
                else:
                    self._state = _CONTENT
            elif state == _REASONING:
                closing = parser._first_closing(text)
                if closing is None:
                    held = 0 if final else max(partial_suffix(text, tag)
                                               for tag in parser._closing_tags)
                    reasoning += text[: len(text) - held]
                    text = text[len(text) - held:]
                    break
                at, tag = closing
                reasoning += text[:at]
                if tag == parser.end_tag:
                    text = text[at + len(tag):]
                    self._state = _AFTER_END
                else:  # a tool call opened in the thinking: it is content
                    text = text[at:]
                    self._state = _CONTENT
            elif state == _AFTER_END:
                text = text.lstrip("\r\n")
                if not text:
                    break
                self._state = _CONTENT
            else:
                content += text
                text = ""
                break
        self._pending = text
        return reasoning, content

    def _enter_reasoning(self) -> None:
        self._state = _REASONING
        self.had_reasoning = True


def _family(name: str, starts_in_reasoning: bool, **options: Any) -> ReasoningParser:
    return ReasoningParser(name, THINK_START, THINK_END, starts_in_reasoning, **options)


_PARSERS: dict[str, ReasoningParser] = {
    parser.name: parser
    for parser in (
        # Always thinks; R1 writes no start tag (its template opened it), R1-0528 writes one.
        _family("deepseek-r1", starts_in_reasoning=True),
        # V3.1 thinks only when asked (``thinking``); its template then opens the thinking.
        _family("deepseek-v3", starts_in_reasoning=True, thinking_switch="thinking",
                thinking_default=False),
        # Qwen3 writes ``<think>`` itself; enable_thinking=false puts an empty one in the
        # prompt.
        _family("qwen3", starts_in_reasoning=False, thinking_switch="enable_thinking",
                tool_call_tag=QWEN_TOOL_CALL),
        # Qwen3-*-Thinking-2507: the template opens the thinking, always.
        _family("qwen3-thinking", starts_in_reasoning=True, tool_call_tag=QWEN_TOOL_CALL),
        _family("glm45", starts_in_reasoning=False, thinking_switch="enable_thinking",
                tool_call_tag=QWEN_TOOL_CALL),
        ReasoningParser("kimi", "◁think▷", "◁/think▷", starts_in_reasoning=False),
        _family("step3", starts_in_reasoning=True),
        # MiniMax-M1/M2's template opens the thinking (SGLang forces reasoning for it).
        _family("minimax", starts_in_reasoning=True),
    )
}

REASONING_PARSERS: tuple[str, ...] = tuple(_PARSERS)
"""The names ``--reasoning-parser`` accepts."""


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The family named ``name``; ``ValueError`` naming the known ones if there is none."""
    parser = _PARSERS.get(name)
    if parser is None:
        raise ValueError(f"--reasoning-parser {name!r} is unknown; known: "
                         f"{', '.join(REASONING_PARSERS)}")
    return parser
