"""Engine outputs in the OpenAI API's shapes: finish reasons, usage and logprobs, whole or
as a stream's choices progress."""

from __future__ import annotations

from typing import Any

from radixlm.runtime.engine.request_state import OutputDelta
from radixlm.runtime.server.openai_protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)


def meta_finish_reason(meta: dict[str, Any]) -> str | None:
    return finish_type(meta.get("finish_reason"))


def finish_type(reason: dict[str, Any] | None) -> str | None:
    return None if reason is None else reason["type"]


def outputs_usage(outputs: list[dict[str, Any]], n: int) -> Usage:
    """Usage of whole outputs (native shape), ``n`` samples per prompt."""
    return usage_of([(out["meta_info"]["prompt_tokens"], out["meta_info"]["completion_tokens"],
                       out["meta_info"]["cached_tokens"]) for out in outputs], n)


def usage_of(counts: list[tuple[int, int, int]], n: int) -> Usage:
    """Usage from each choice's (prompt, completion, cached) tokens. Prompt tokens count
    once per prompt (its ``n`` samples share one prefill)."""
    firsts = counts[::n]
    prompt = sum(prompt_tokens for prompt_tokens, _, _ in firsts)
    completion = sum(completion_tokens for _, completion_tokens, _ in counts)
    cached = sum(cached_tokens for _, _, cached_tokens in firsts)
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


Logprobs = tuple[list[list[Any]], list[list[list[Any]] | None]]
"""Entries ``[logprob, token_id, text]`` and, per entry, its top alternatives (or None)."""


def meta_logprobs(meta: dict[str, Any], part: str) -> Logprobs:
    """The ``input`` or ``output`` logprobs of a native ``meta_info``."""
    entries = meta[f"{part}_token_logprobs"]
    return entries, meta.get(f"{part}_top_logprobs") or [None] * len(entries)


def delta_logprobs(delta: OutputDelta) -> Logprobs:
    """The output logprobs a delta brings."""
    entries = delta.output_token_logprobs
    return entries, delta.output_top_logprobs or [None] * len(entries)


def completion_logprobs(entries: list, tops: list, offset: int,
                         prompt: Logprobs | None = None) -> CompletionLogprobs:
    """Completion logprobs of ``entries`` (after the ``prompt``'s, for ``echo``), their
    ``text_offset``s counting from ``offset``."""
    if prompt is not None:
        entries, tops = prompt[0] + entries, prompt[1] + tops
    result = CompletionLogprobs()
    for (logprob, _, text), top in zip(entries, tops):
        result.tokens.append(text)
        result.token_logprobs.append(logprob)
        # Distinct tokens may share a text (partial UTF-8 decodes to U+FFFD): keep the best.
        result.top_logprobs.append(None if top is None else {t: lp for lp, _, t in top[::-1]})
        result.text_offset.append(offset)
        offset += len(text)
    return result


def chat_logprobs(entries: list, tops: list) -> ChatLogprobs:
    return ChatLogprobs(content=[
        TokenLogprob(token=text, logprob=logprob, bytes=list(text.encode()), top_logprobs=[
            TopLogprob(token=t, logprob=lp, bytes=list(t.encode())) for lp, _, t in top or []
        ])
        for (logprob, _, text), top in zip(entries, tops)
    ])




class ChoiceProgress:
    """What one choice's stream has sent, and the counts its usage needs."""

    def __init__(self) -> None:
        self.started = False
        self.logprob_chars = 0  # the next ``text_offset``: the texts of the tokens sent
        self.counts = (0, 0, 0)  # prompt, completion and cached tokens

    def advance(self, delta: OutputDelta) -> None:
        self.counts = (delta.prompt_tokens, self.counts[1] + len(delta.new_ids),
                       delta.cached_tokens)


def final_usage(progress: dict[int, ChoiceProgress], n: int) -> Usage:
    return usage_of([progress[i].counts for i in sorted(progress)], n)
