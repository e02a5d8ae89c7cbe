"""A request's outputs on the TokenizerManager's side: deltas in, and the native shape out.

The Scheduler's ``TokenOut`` (tokens, logprobs, state) and the Detokenizer's ``TextOut``
(the text those tokens add) arrive on one socket but from two processes, so a request pairs
them in order (see ``messages.py``): each pair is one ``OutputDelta``. A streaming caller
takes the deltas as they come; a caller that wants the whole result has them folded into a
``NativeOutput`` as they arrive. Nothing is copied per delta beyond the delta itself.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime import messages as io
from radixlm.runtime.engine.errors import RuntimeUnavailable


@dataclass
class OutputDelta:
    """What one request gained in one step: its new tokens (with their logprobs and the
    request's counters) and the text they add. ``trim`` characters of the text before
    are taken back first (only on a request's last delta)."""

    tokens: io.TokenOut
    text: str = ""
    trim: int = 0

    @property
    def finish_reason(self) -> dict[str, Any] | None:
        return self.tokens.finish_reason

    def then(self, later: OutputDelta) -> OutputDelta:
        """This delta followed by ``later``, as one."""
        first, second = self.tokens, later.tokens
        tokens = io.TokenOut(
            rid=second.rid,
            new_ids=first.new_ids + second.new_ids,
            finish_reason=second.finish_reason,
            prompt_tokens=second.prompt_tokens,
            cached_tokens=second.cached_tokens,
            retractions=second.retractions,
            jump_forward_tokens=second.jump_forward_tokens,
            input_token_logprobs=first.input_token_logprobs + second.input_token_logprobs,
            input_top_logprobs=first.input_top_logprobs + second.input_top_logprobs,
            output_token_logprobs=first.output_token_logprobs + second.output_token_logprobs,
            output_top_logprobs=first.output_top_logprobs + second.output_top_logprobs,
            beam=second.beam,
        )
        if later.trim <= len(self.text):
            return OutputDelta(tokens, self.text[: len(self.text) - later.trim] + later.text,
                               self.trim)
        return OutputDelta(tokens, later.text, self.trim + later.trim - len(self.text))


class NativeOutput:
    """A request's output in the native API's shape, ``{"text", "output_ids", "meta_info"}``,
    built up from its deltas (text cumulative, as SGLang's native API sends it)."""

    def __init__(self, rid: str, prompt_tokens: int, return_logprob: bool, top_logprobs: bool,
                 created: float):
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self.return_logprob = return_logprob
        self.top_logprobs = top_logprobs
        self.created = created
        self.text = ""
        self.output_ids: list[int] = []
        self.last: io.TokenOut | None = None
        self.input_token_logprobs: list = []
        self.input_top_logprobs: list = []
        self.output_token_logprobs: list = []
        self.output_top_logprobs: list = []

    def add(self, delta: OutputDelta) -> None:
        tokens = delta.tokens
        if delta.trim:
            self.text = self.text[: len(self.text) - delta.trim]
        self.text += delta.text
        self.output_ids += tokens.new_ids
        self.last = tokens
        if self.return_logprob:
            self.input_token_logprobs += tokens.input_token_logprobs
            self.output_token_logprobs += tokens.output_token_logprobs
            if self.top_logprobs:
                self.input_top_logprobs += tokens.input_top_logprobs
                self.output_top_logprobs += tokens.output_top_logprobs

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


@dataclass
class ReqState:
    """One request in flight, as the TokenizerManager sees it.

    Invariants: ``pending_tokens`` holds the request's ``TokenOut``s that await their text
    and ``pending_text`` the ``TextOut``s that await their tokens; at most one of them is
    non-empty. A streamed request queues its paired deltas in ``deltas`` for its consumer,
    except that a delta without tokens (prompt logprobs of a prefill chunk) is held in
    ``held`` and joined to the next one, so every delta a consumer sees brings tokens or
    ends the request; any other request folds its deltas into ``output``.
    """

    rid: str
    prompt_tokens: int
    return_logprob: bool
    top_logprobs: bool
    streamed: bool
    created: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    completion_tokens: int = 0
    finish_reason: dict[str, Any] | None = None
    cached_tokens: int = 0
    error: str | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    deltas: deque[OutputDelta] = field(default_factory=deque)
    pending_tokens: deque[io.TokenOut] = field(default_factory=deque)
    pending_text: deque[io.TextOut] = field(default_factory=deque)
    held: OutputDelta | None = None
    output: NativeOutput | None = None
    counters: io.OutputState = field(default_factory=lambda: io.OutputState(0, 0, 0))
    """The counters last received (their finish and logprobs are not this state's)."""

    def __post_init__(self) -> None:
        if not self.streamed:
            self.output = NativeOutput(self.rid, self.prompt_tokens, self.return_logprob,
                                       self.top_logprobs, self.created)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def add_tokens(self, new_ids: list[int], update: io.OutputState | None) -> None:
        """A row of a ``TokenBatch``: the request's new tokens and, where sent, its new
        counters, finish and logprobs."""
        if update is not None:
            self.counters = update
        counters = self.counters
        out = io.TokenOut(self.rid, new_ids, None, self.prompt_tokens, counters.cached_tokens,
                          counters.retractions, counters.jump_forward_tokens)
        if update is not None:
            out.finish_reason = update.finish_reason
            out.input_token_logprobs = update.input_token_logprobs
            out.input_top_logprobs = update.input_top_logprobs
            out.output_token_logprobs = update.output_token_logprobs
            out.output_top_logprobs = update.output_top_logprobs
            out.beam = update.beam
        if not out.has_text:  # prompt logprobs of a chunk: the Detokenizer never saw them
            self._apply(OutputDelta(out))
        elif self.pending_text:
            text = self.pending_text.popleft()
            self._apply(OutputDelta(out, text.text, text.trim))
        else:
            self.pending_tokens.append(out)

    def add_text(self, out: io.TextOut) -> None:
        if self.pending_tokens:
            self._apply(OutputDelta(self.pending_tokens.popleft(), out.text, out.trim))
        else:
            self.pending_text.append(out)

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

    def result(self) -> dict[str, Any]:
        """The whole output of a request that was not streamed."""
        if self.error is not None:
            raise RuntimeUnavailable(self.error)
        return self.output.render()

    def _apply(self, delta: OutputDelta) -> None:
        tokens = delta.tokens
        if tokens.new_ids and self.first_token is None:
            self.first_token = time.perf_counter()
        self.completion_tokens += len(tokens.new_ids)
        self.cached_tokens = tokens.cached_tokens
        self.finish_reason = tokens.finish_reason
        if not self.streamed:
            self.output.add(delta)
        elif not tokens.has_text:
            self.held = delta if self.held is None else self.held.then(delta)
            return
        else:
            if self.held is not None:
                delta, self.held = self.held.then(delta), None
            self.deltas.append(delta)
        self.changed.set()
