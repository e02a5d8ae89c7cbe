"""A request's outputs on the RequestTracker's side: one ``OutputDelta`` per row received.

Each row of the Detokenizer's ``OutputBatch`` carries everything a request gained in a step
(its new tokens, their logprobs, its counters and finish, and the text they add), so a row
becomes one delta as it arrives. A caller takes the deltas queued since it last looked, as
one (``ReqState.take_deltas``); the native shape is built from them in ``native_output.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime import messages as wire


@dataclass
class OutputDelta:
    """What one request gained since its previous delta: its new tokens (with their logprobs)
    and the text they add, and its counters and finish as they stand. ``trim`` characters
    of the text before are taken back first (only on a request's last delta)."""

    rid: str
    new_ids: list[int]
    text: str
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    cached_tokens: int
    retractions: int
    jump_forward_tokens: int = 0
    trim: int = 0
    spec_verify_ct: int = 0
    input_token_logprobs: list[wire.LogprobEntry] = field(default_factory=list)
    input_top_logprobs: list[Any] = field(default_factory=list)
    output_token_logprobs: list[wire.LogprobEntry] = field(default_factory=list)
    output_top_logprobs: list[Any] = field(default_factory=list)
    beam: list[float] | None = None
    """A beam search's hypothesis, with its finish: [cumulative logprob, score]."""

    def then(self, later: OutputDelta) -> OutputDelta:
        """This delta followed by ``later``, as one."""
        if later.trim <= len(self.text):
            text, trim = self.text[: len(self.text) - later.trim] + later.text, self.trim
        else:
            text, trim = later.text, self.trim + later.trim - len(self.text)
        return OutputDelta(
            rid=later.rid,
            new_ids=self.new_ids + later.new_ids,
            text=text,
            finish_reason=later.finish_reason,
            prompt_tokens=later.prompt_tokens,
            cached_tokens=later.cached_tokens,
            retractions=later.retractions,
            jump_forward_tokens=later.jump_forward_tokens,
            trim=trim,
            spec_verify_ct=later.spec_verify_ct,
            input_token_logprobs=self.input_token_logprobs + later.input_token_logprobs,
            input_top_logprobs=self.input_top_logprobs + later.input_top_logprobs,
            output_token_logprobs=self.output_token_logprobs + later.output_token_logprobs,
            output_top_logprobs=self.output_top_logprobs + later.output_top_logprobs,
            beam=later.beam,
        )


@dataclass
class ReqState:
    """One request in flight, as the RequestTracker sees it.

    Invariants: ``deltas`` holds, in order, what arrived since the consumer last looked; a
    row that brings neither tokens nor a finish (a prompt chunk's logprobs) is ``held`` and
    goes out with the next one, so a stream never shows an empty step; ``changed`` is set
    whenever ``deltas``, ``finished`` or ``error`` changed.
    """

    rid: str
    prompt_tokens: int
    created: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    completion_tokens: int = 0
    finish_reason: dict[str, Any] | None = None
    cached_tokens: int = 0
    error: str | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    deltas: deque[OutputDelta] = field(default_factory=deque)
    held: OutputDelta | None = None
    counters: wire.OutputState = field(default_factory=lambda: wire.OutputState(0, 0, 0))
    """The counters last received (their finish and logprobs are not this state's)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def add(self, new_ids: list[int], text: str, trim: int,
            update: wire.OutputState | None) -> None:
        """A row of an ``OutputBatch``: the request's new tokens, their text and, where sent,
        its new counters, finish and logprobs."""
        if update is not None:
            self.counters = update
        counters = self.counters
        delta = OutputDelta(self.rid, new_ids, text, None, self.prompt_tokens,
                            counters.cached_tokens, counters.retractions,
                            counters.jump_forward_tokens, trim, counters.spec_verify_ct)
        if update is not None:
            delta.finish_reason = update.finish_reason
            delta.input_token_logprobs = update.input_token_logprobs
            delta.input_top_logprobs = update.input_top_logprobs
            delta.output_token_logprobs = update.output_token_logprobs
            delta.output_top_logprobs = update.output_top_logprobs
            delta.beam = update.beam
        if new_ids and self.first_token is None:
            self.first_token = time.perf_counter()
        self.completion_tokens += len(new_ids)
        self.cached_tokens = counters.cached_tokens
        self.finish_reason = delta.finish_reason
        if self.held is not None:
            delta, self.held = self.held.then(delta), None
        if not new_ids and delta.finish_reason is None:
            self.held = delta
            return
        self.deltas.append(delta)
        self.changed.set()

    def take_deltas(self) -> OutputDelta | None:
        """Everything queued for the consumer since it last looked, as one delta."""
        if not self.deltas:
            return None
        delta = self.deltas.popleft()
        while self.deltas:
            delta = delta.then(self.deltas.popleft())
        return delta

    def fail(self, reason: str) -> None:
        self.error = reason
        self.changed.set()
