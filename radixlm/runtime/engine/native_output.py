"""The native API's output, ``{"text", "output_ids", "meta_info"}``: the one place it is built.

Both the Engine's API and the HTTP server's ``/generate`` take it from here: a whole result
(``native_results``) or a stream of chunks (``native_chunks``), each folded from a
request's ``OutputDelta``s by a ``NativeOutput``.

A stream's chunks are cumulative by default, as SGLang's native API sends them: each holds
the whole output so far. With ``incremental`` (``ServerArgs.incremental_streaming_output``)
each holds its own segment instead: its ``text``, ``output_ids`` and the output-side lists
of ``OUTPUT_LISTS`` are what was added since the previous chunk, so a request's segments are
disjoint and concatenate to its whole output. Either way the counters
(``completion_tokens``, ``output_token_logprobs_length``) count the whole output so far,
and the prompt-side logprobs are whole, as SGLang's tokenizer manager sends them. A
segment cannot take back text an earlier one sent: where a stop regex matched text already
streamed (a delta's ``trim``), that text stays sent and no later segment repeats it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from radixlm.runtime import messages as wire
from radixlm.runtime.engine.request_state import OutputDelta

OUTPUT_LISTS = ("output_token_logprobs", "output_top_logprobs")
"""The meta_info lists that run along the output: an incremental chunk carries its part."""


class NativeOutput:
    """A request's output in the native shape, built up from its deltas.

    Invariant: ``shown`` holds, for the text, ``output_ids`` and each of ``OUTPUT_LISTS``,
    how much of it the segments rendered so far cover; ``render(segment=True)`` moves it to
    the end (for text a trim cut below it, to the new end: a segment starts at or after it).
    """

    def __init__(self, req: wire.GenerateReq):
        self.rid = req.rid
        self.prompt_tokens = len(req.input_ids)
        self.return_logprob = req.return_logprob
        self.top_logprobs = req.top_logprobs_num > 0
        self.created = time.perf_counter()
        self.text = ""
        self.output_ids: list[int] = []
        self.last: OutputDelta | None = None
        self.input_token_logprobs: list = []
        self.input_top_logprobs: list = []
        self.output_token_logprobs: list = []
        self.output_top_logprobs: list = []
        self.shown = {"text": 0, "output_ids": 0, **dict.fromkeys(OUTPUT_LISTS, 0)}

    def add(self, delta: OutputDelta) -> None:
        if delta.trim:
            self.text = self.text[: len(self.text) - delta.trim]
        self.text += delta.text
        self.output_ids += delta.new_ids
        self.last = delta
        if self.return_logprob:
            self.input_token_logprobs += delta.input_token_logprobs
            self.output_token_logprobs += delta.output_token_logprobs
            if self.top_logprobs:
                self.input_top_logprobs += delta.input_top_logprobs
                self.output_top_logprobs += delta.output_top_logprobs

    def render(self, segment: bool = False) -> dict[str, Any]:
        """The output so far, or with ``segment`` only what was added since the previous
        segment (text, ids and ``OUTPUT_LISTS``; counters still count everything). Its lists
        are copies, so later deltas do not change it."""
        start = self.shown if segment else dict.fromkeys(self.shown, 0)
        if segment:
            self.shown = {"text": len(self.text), "output_ids": len(self.output_ids),
                          **{name: len(getattr(self, name)) for name in OUTPUT_LISTS}}
        last = self.last
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": last.finish_reason if last else None,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": last.cached_tokens if last else 0,
            "total_retractions": last.retractions if last else 0,
            "jump_forward_tokens": last.jump_forward_tokens if last else 0,
            "e2e_latency": time.perf_counter() - self.created,
        }
        if last is not None and last.spec_verify_ct:
            meta["spec_verify_ct"] = last.spec_verify_ct
        if last is not None and last.beam is not None:
            meta["cumulative_logprob"], meta["beam_score"] = last.beam
        if self.return_logprob:
            meta["input_token_logprobs"] = list(self.input_token_logprobs)
            meta["output_token_logprobs"] = self.output_token_logprobs[
                start["output_token_logprobs"]:]
            meta["output_token_logprobs_length"] = len(self.output_token_logprobs)
            if self.top_logprobs:
                meta["input_top_logprobs"] = list(self.input_top_logprobs)
                meta["output_top_logprobs"] = self.output_top_logprobs[
                    start["output_top_logprobs"]:]
        return {"text": self.text[start["text"]:],
                "output_ids": self.output_ids[start["output_ids"]:], "meta_info": meta}


async def native_results(deltas: AsyncIterator[tuple[int, OutputDelta]],
                         reqs: list[wire.GenerateReq]) -> list[dict[str, Any]]:
    """The whole output of each of ``reqs``, in order, from their ``(index, delta)``
    stream (closed when this ends, so a cancelled call aborts what is unfinished)."""
    outputs = [NativeOutput(req) for req in reqs]
    try:
        async for index, delta in deltas:
            outputs[index].add(delta)
    finally:
        await deltas.aclose()
    return [output.render() for output in outputs]


async def native_chunks(deltas: AsyncIterator[tuple[int, OutputDelta]],
                        reqs: list[wire.GenerateReq],
                        batched: bool,
                        incremental: bool = False) -> AsyncIterator[dict[str, Any]]:
    """The native stream: one chunk per delta, the request's whole output so far, or with
    ``incremental`` the delta's own segment (with its prompt's ``index`` when
    ``batched``). Closing it closes ``deltas``."""
    outputs = [NativeOutput(req) for req in reqs]
    try:
        async for index, delta in deltas:
            output = outputs[index]
            output.add(delta)
            chunk = output.render(segment=True) if incremental else output.render()
            if batched:
                chunk["index"] = index
            yield chunk
    finally:
        await deltas.aclose()
