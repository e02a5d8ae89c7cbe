"""The TokenizerManager: the front process's side of the runtime, on an asyncio loop.

It sends validated, tokenized requests to the Scheduler, receives their text from the
Detokenizer, keeps each request's state (text, tokens, logprobs, meta) and wakes whoever
waits for it. It watches the child processes: if one dies, every pending call fails at once
with the reason, and every later call is refused.
"""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from radixlm.runtime import messages as io

CHILD_CHECK_INTERVAL_S = 0.2
CONTROL_TIMEOUT_S = 30.0


class RuntimeUnavailable(RuntimeError):
    """A runtime process died or the runtime was shut down."""


class QueueFull(RuntimeError):
    """More requests are in flight than the runtime accepts (``max_queued_requests``)."""


@dataclass
class ReqState:
    """What the client has of one request so far."""

    rid: str
    prompt_tokens: int
    return_logprob: bool
    top_logprobs: bool
    created: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    cached_tokens: int = 0
    retractions: int = 0
    jump_forward_tokens: int = 0
    input_token_logprobs: list = field(default_factory=list)
    input_top_logprobs: list = field(default_factory=list)
    output_token_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    error: str | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def apply(self, out: io.TextOut) -> None:
        tokens = out.tokens
        if tokens.new_ids and self.first_token is None:
            self.first_token = time.perf_counter()
        self.text = out.text
        self.output_ids += tokens.new_ids
        self.finish_reason = tokens.finish_reason
        self.cached_tokens = tokens.cached_tokens
        self.retractions = tokens.retractions
        self.jump_forward_tokens = tokens.jump_forward_tokens
        self.input_token_logprobs += tokens.input_token_logprobs
        self.input_top_logprobs += tokens.input_top_logprobs
        self.output_token_logprobs += tokens.output_token_logprobs
        self.output_top_logprobs += tokens.output_top_logprobs
        self.changed.set()

    def output(self) -> dict[str, Any]:
        """The native API's ``{"text", "output_ids", "meta_info"}``."""
        if self.error is not None:
            raise RuntimeUnavailable(self.error)
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "total_retractions": self.retractions,
            "jump_forward_tokens": self.jump_forward_tokens,
            "e2e_latency": time.perf_counter() - self.created,
        }
        if self.return_logprob:
            meta["input_token_logprobs"] = list(self.input_token_logprobs)
            meta["output_token_logprobs"] = list(self.output_token_logprobs)
            if self.top_logprobs:
                meta["input_top_logprobs"] = list(self.input_top_logprobs)
                meta["output_top_logprobs"] = list(self.output_top_logprobs)
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}


class TokenizerManager:
    """Runs on one event loop; every method must be called from that loop."""

    def __init__(self, paths, processes: dict[str, subprocess.Popen],
                 max_in_flight: int | None = None):
        """``max_in_flight``: unfinished requests accepted at once (None: no limit)."""
        self.context = zmq.asyncio.Context()
        self.to_scheduler = self.context.socket(zmq.PUSH)
        self.to_scheduler.connect(paths.scheduler)
        self.to_detokenizer = self.context.socket(zmq.PUSH)
        self.to_detokenizer.connect(paths.detokenizer)
        self.inbox = self.context.socket(zmq.PULL)
        self.inbox.bind(paths.tokenizer_manager)
        self.processes = processes
        self.states: dict[str, ReqState] = {}
        self.control_waiters: dict[int, asyncio.Future] = {}
        self._control_ids = itertools.count(1)
        self.failure: str | None = None
        self.max_in_flight = max_in_flight
        self.metrics = None
        """A ``ServerMetrics`` told of every finished request, when set."""
        self._tasks = [
            asyncio.ensure_future(self._receive_loop()),
            asyncio.ensure_future(self._watch_children()),
        ]

    # Requests --------------------------------------------------------------------------

    async def submit(self, reqs: list[io.GenerateReq]) -> list[ReqState]:
        self._check_alive()
        duplicate = [r.rid for r in reqs if r.rid in self.states]
        if duplicate:
            raise ValueError(f"rid {duplicate[0]!r} is already in use by a running request")
        if self.max_in_flight is not None and len(self.states) + len(reqs) > self.max_in_flight:
            raise QueueFull(
                f"the server is busy: {len(self.states)} requests in flight, at most "
                f"{self.max_in_flight} accepted; retry later"
            )
        states = []
        for req in reqs:
            state = ReqState(req.rid, len(req.input_ids), req.return_logprob,
                             req.top_logprobs_num > 0)
            self.states[req.rid] = state
            states.append(state)
        for req in reqs:
            await self.to_scheduler.send(io.encode(req))
        return states

    async def collect(self, reqs: list[io.GenerateReq]) -> list[dict[str, Any]]:
        """Runs the requests to the end; their final outputs, in order."""
        states = await self.submit(reqs)
        for state in states:
            while not state.finished:
                await state.changed.wait()
                state.changed.clear()
        return [state.output() for state in states]

    async def stream(self, reqs: list[io.GenerateReq], batched: bool) -> AsyncIterator[dict]:
        """A chunk whenever a request gained tokens, and one when it ends (``index`` tags
        the request's position when ``batched``). Unfinished requests are aborted if the
        consumer stops early."""
        states = await self.submit(reqs)
        sent = [0] * len(states)
        done: set[int] = set()
        try:
            while len(done) < len(states):
                for index, state in enumerate(states):
                    if index in done or (
                        not state.finished and len(state.output_ids) == sent[index]
                    ):
                        continue
                    sent[index] = len(state.output_ids)
                    if state.finished:
                        done.add(index)
                    chunk = state.output()
                    if batched:
                        chunk["index"] = index
                    yield chunk
                if len(done) < len(states):
                    await self._any_changed(states)
        finally:
            for state in states:
                if not state.finished and self.failure is None:
                    await self.abort(state.rid)

    async def abort(self, rid: str | None) -> None:
        self._check_alive()
        await self.to_scheduler.send(io.encode(io.AbortReq(rid)))

    async def control(self, kind: str) -> io.ControlReply:
        self._check_alive()
        request_id = next(self._control_ids)
        future = asyncio.get_running_loop().create_future()
        self.control_waiters[request_id] = future
        await self.to_scheduler.send(io.encode(io.ControlReq(kind, request_id)))
        try:
            return await asyncio.wait_for(future, CONTROL_TIMEOUT_S)
        finally:
            self.control_waiters.pop(request_id, None)

    async def shutdown(self) -> None:
        for socket in (self.to_scheduler, self.to_detokenizer):
            await socket.send(io.encode(io.ControlReq("shutdown")))
        self._fail("the runtime was shut down")
        for task in self._tasks:
            task.cancel()

    def close(self) -> None:
        self.context.destroy(linger=0)

    # Internals -------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise RuntimeUnavailable(self.failure)

    async def _any_changed(self, states: list[ReqState]) -> None:
        waits = [asyncio.ensure_future(s.changed.wait()) for s in states if not s.finished]
        if not waits:
            return
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        for state in states:
            state.changed.clear()

    async def _receive_loop(self) -> None:
        while True:
            msg = io.decode(await self.inbox.recv())
            if isinstance(msg, io.TextBatch):
                for out in msg.outputs:
                    state = self.states.get(out.tokens.rid)
                    if state is not None:
                        state.apply(out)
                        if state.finished:
                            del self.states[state.rid]
                            if self.metrics is not None:
                                meta = state.output()["meta_info"]
                                self.metrics.observe_finished(state.created, state.first_token,
                                                              meta)
            elif isinstance(msg, io.ControlReply):
                future = self.control_waiters.get(msg.request_id)
                if future is not None and not future.done():
                    future.set_result(msg)
            elif isinstance(msg, io.ProcessFailed):
                self._fail(f"the {msg.process} process failed: {msg.message}")

    async def _watch_children(self) -> None:
        while self.failure is None:
            await asyncio.sleep(CHILD_CHECK_INTERVAL_S)
            for name, process in self.processes.items():
                if process.poll() is not None:
                    self._fail(f"the {name} process died (exit code {process.returncode})")
                    return

    def _fail(self, reason: str) -> None:
        """Fails every pending request and control call; refuses all later ones."""
        if self.failure is not None:
            return
        self.failure = reason
        for state in self.states.values():
            state.error = reason
            state.changed.set()
        self.states.clear()
        for future in self.control_waiters.values():
            if not future.done():
                future.set_exception(RuntimeUnavailable(reason))
