"""The native API's output, ``{"text", "output_ids", "meta_info"}``: the one place it is built.

Both the Engine's API and the HTTP server's ``/generate`` take it from here: a whole result
(``native_results``) or a stream of cumulative chunks (``native_chunks``), each folded from
a request's ``OutputDelta``s by a ``NativeOutput``. Text is cumulative, as SGLang's native
API sends it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from radixlm.runtime import messages as wire
from radixlm.runtime.engine.request_state import OutputDelta


class NativeOutput:
    """A request's output in the native shape, built up from its deltas."""

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

    def render(self) -> dict[str, Any]:
        """The output so far; its lists are copies, so later deltas do not change it."""
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
        if last is not None and last.beam is not None:
            meta["cumulative_logprob"], meta["beam_score"] = last.beam
        if self.return_logprob:
            meta["input_token_logprobs"] = list(self.input_token_logprobs)
            meta["output_token_logprobs"] = list(self.output_token_logprobs)
            if self.top_logprobs:
                meta["input_top_logprobs"] = list(self.input_top_logprobs)
                meta["output_top_logprobs"] = list(self.output_top_logprobs)
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}


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
                        batched: bool) -> AsyncIterator[dict[str, Any]]:
    """The native stream: one chunk per delta, the request's whole output so far (with its
    prompt's ``index`` when ``batched``). Closing it closes ``deltas``."""
    outputs = [NativeOutput(req) for req in reqs]
    try:
        async for index, delta in deltas:
            output = outputs[index]
            output.add(delta)
            chunk = output.render()
            if batched:
                chunk["index"] = index
            yield chunk
    finally:
        await deltas.aclose()
