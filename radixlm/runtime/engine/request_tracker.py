"""The RequestTracker: the front process's side of the runtime, on an asyncio loop.

It tracks every request in flight; it tokenizes nothing (the Engine does, in
``request_inputs.py``, before a request reaches it). It sends validated, tokenized requests
to the Scheduler, receives each request's output as
deltas from the Detokenizer (one ``OutputBatch`` per step: tokens, logprobs, states and
text together), and hands them on to the request's caller as they come
(``request_state.py``). It watches the child processes: if one dies, every pending call
fails at once with the reason, and every later call is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import subprocess
import time
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from radixlm.runtime import messages as wire
from radixlm.runtime.engine.errors import QueueFull, RuntimeUnavailable
from radixlm.runtime.engine.request_state import OutputDelta, ReqState
from radixlm.runtime.free_memory import IdleTrim

CHILD_CHECK_INTERVAL_S = 0.2
CONTROL_TIMEOUT_S = 30.0
DRAIN_POLL_S = 0.01


class RequestTracker:
    """Runs on one event loop; every method must be called from that loop."""

    def __init__(self, paths: wire.SocketPaths, processes: dict[str, subprocess.Popen],
                 max_in_flight: int | None = None, metrics=None):
        """``max_in_flight``: unfinished requests accepted at once (None: no limit);
        ``metrics``: a ``ServerMetrics`` told of every finished request (or None)."""
        self.context = zmq.asyncio.Context()
        self.to_scheduler = self.context.socket(zmq.PUSH)
        self.to_scheduler.connect(paths.scheduler)
        self.to_detokenizer = self.context.socket(zmq.PUSH)
        self.to_detokenizer.connect(paths.detokenizer)
        self.inbox = self.context.socket(zmq.PULL)
        self.inbox.bind(paths.request_tracker)
        self.processes = processes
        self.states: dict[str, ReqState] = {}
        self.control_waiters: dict[int, asyncio.Future] = {}
        self._control_ids = itertools.count(1)
        self.failure: str | None = None
        self.refusing: str | None = None
        """Why new requests are refused while those in flight drain (None: accepting)."""
        self.max_in_flight = max_in_flight
        self.metrics = metrics
        self.last_heartbeat = time.monotonic()
        """When the Scheduler last showed that its loop turns (any message from it)."""
        self.received_bytes = 0
        """Bytes of every message received (a stream of N tokens costs O(N) of them)."""
        self.trim = IdleTrim()
        """Free heap pages go back to the system once requests stop (``free_memory``)."""
        self._tasks = [
            asyncio.ensure_future(self._receive_loop()),
            asyncio.ensure_future(self._watch_children()),
        ]

    # Requests --------------------------------------------------------------------------

    async def submit(self, reqs: list[wire.GenerateReq], streamed: bool) -> list[ReqState]:
        """Registers and sends ``reqs``; raises (registering none of them) for a rid in use
        or given twice, a full queue, or a request that cannot be encoded."""
        self._check_alive()
        if self.refusing is not None:
            raise RuntimeUnavailable(self.refusing)
        duplicate = [r.rid for r in reqs if r.rid in self.states]
        if duplicate:
            raise ValueError(f"rid {duplicate[0]!r} is already in use by a running request")
        if len({r.rid for r in reqs}) < len(reqs):
            raise ValueError("a rid is given to more than one request of the batch")
        for req in reqs:
            req.streamed = streamed
        try:
            payloads = [wire.encode(req) for req in reqs]
        except UnicodeEncodeError as err:  # a lone surrogate in some string (rid, stop, ...)
            raise ValueError(f"the request holds text that is not valid Unicode: {err.reason} "
                             f"in {err.object[max(err.start - 20, 0):err.end + 20]!r}") from None
        if self.max_in_flight is not None and len(self.states) + len(reqs) > self.max_in_flight:
            raise QueueFull(
                f"the server is busy: {len(self.states)} requests in flight, at most "
                f"{self.max_in_flight} accepted; retry later"
            )
        states = []
        for req in reqs:
            state = ReqState(req.rid, len(req.input_ids))
            self.states[req.rid] = state
            states.append(state)
        self.trim.busy()
        # One message of a frame a request: ZMQ delivers it whole, so the Scheduler admits
        # the batch together (sent one by one, its first requests were often prefilled
        # alone, in a pass of their own).
        if payloads:
            await self.to_scheduler.send_multipart(payloads)
        return states

    async def stream(self, reqs: list[wire.GenerateReq], streamed: bool = True
                     ) -> AsyncIterator[tuple[int, OutputDelta]]:
        """``(index, delta)`` for the output of each request (``index``: its position in
        ``reqs``) as it arrives: one delta per step, or one for all the steps that arrived
        since the consumer last looked; a request's last delta has its finish reason.
        Unfinished requests are aborted if the consumer stops early. ``streamed`` False: the
        caller reads only the end, so the Scheduler reports the requests less often."""
        states = await self.submit(reqs, streamed)
        try:
            while True:
                for index, state in enumerate(states):
                    if (delta := state.take_deltas()) is not None:
                        yield index, delta
                    if state.error is not None:
                        raise RuntimeUnavailable(state.error)
                if all(state.finished and not state.deltas for state in states):
                    return
                await self._any_changed(states)
        finally:
            await self._abort_unfinished(states)

    async def abort(self, rid: str | None) -> None:
        self._check_alive()
        await self.to_scheduler.send(wire.encode(wire.AbortReq(rid)))

    async def _abort_unfinished(self, states: list[ReqState]) -> None:
        for state in states:
            if not state.finished and self.failure is None:
                await self.abort(state.rid)

    async def control(self, kind: str, args: dict[str, str] | None = None
                      ) -> wire.ControlReply:
        self._check_alive()
        request_id = next(self._control_ids)
        future = asyncio.get_running_loop().create_future()
        self.control_waiters[request_id] = future
        await self.to_scheduler.send(wire.encode(wire.ControlReq(kind, request_id,
                                                                 args or {})))
        try:
            return await asyncio.wait_for(future, CONTROL_TIMEOUT_S)
        finally:
            self.control_waiters.pop(request_id, None)

    async def shutdown(self) -> None:
        for socket in (self.to_scheduler, self.to_detokenizer):
            await socket.send(wire.encode(wire.ControlReq("shutdown")))
        self._fail("the runtime was shut down")
        for task in self._tasks:
            task.cancel()

    async def drain(self, timeout: float) -> None:
        """Waits until no request or control call is in flight, at most ``timeout`` s."""
        deadline = asyncio.get_running_loop().time() + timeout
        while (self.states or self.control_waiters) and self.failure is None:
            if asyncio.get_running_loop().time() >= deadline:
                return
            await asyncio.sleep(DRAIN_POLL_S)

    async def drain_then_end(self, grace_s: float, reason: str) -> None:
        """Refuses new requests (``RuntimeUnavailable(reason)``), lets those in flight end
        within ``grace_s`` seconds, then ends the rest: they fail with ``reason`` (their
        callers see the error) and the Scheduler aborts them."""
        self.refusing = reason
        await self.drain(grace_s)
        if not self.states or self.failure is not None:
            return
        leftover = list(self.states.values())
        self.states.clear()
        for state in leftover:
            await self.to_scheduler.send(wire.encode(wire.AbortReq(state.rid)))
            state.fail(reason)

    async def resume(self) -> None:
        """Accepts new requests again (after ``drain_then_end``)."""
        self.refusing = None

    def close(self, reason: str | None = None) -> None:
        """Stops receiving and closes the sockets; requests still in flight fail with
        ``reason`` (when given)."""
        if reason is not None:
            self._fail(reason)
        for task in self._tasks:
            task.cancel()
        self.context.destroy(linger=0)

    # Internals -------------------------------------------------------------------------

    def stalled_for(self) -> float:
        """Seconds the Scheduler has shown no sign of life while requests wait on it (0
        when none does)."""
        if not self.states:
            return 0.0
        return time.monotonic() - self.last_heartbeat

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
            data = await self.inbox.recv()
            self.received_bytes += len(data)
            msg = wire.decode_or_drop(data, "request tracker")
            if isinstance(msg, (wire.OutputBatch, wire.Heartbeat, wire.ControlReply)):
                self.last_heartbeat = time.monotonic()
            if isinstance(msg, wire.Heartbeat) and not self.states:
                self.trim.idle()
            if isinstance(msg, wire.OutputBatch):
                states, texts, trims = msg.states, msg.texts, msg.trims
                for row, (rid, new_ids) in enumerate(wire.rows(msg.rids, msg.ends, msg.new_ids)):
                    if (state := self.states.get(rid)) is not None:
                        state.add(new_ids, texts[row], trims.get(row, 0), states.get(row))
                        self._retire_if_finished(state)
            elif isinstance(msg, wire.ControlReply):
                future = self.control_waiters.get(msg.request_id)
                if future is not None and not future.done():
                    future.set_result(msg)
            elif isinstance(msg, wire.ProcessFailed):
                self._fail(f"the {msg.process} process failed: {msg.message}")

    def _retire_if_finished(self, state: ReqState) -> None:
        if not state.finished:
            return
        del self.states[state.rid]
        if self.metrics is not None:
            self.metrics.observe_finished(state.created, state.first_token, {
                "prompt_tokens": state.prompt_tokens,
                "completion_tokens": state.completion_tokens,
                "cached_tokens": state.cached_tokens,
                "finish_reason": state.finish_reason,
            })

    async def _watch_children(self) -> None:
        while self.failure is None:
            await asyncio.sleep(CHILD_CHECK_INTERVAL_S)
            for name, process in self.processes.items():
                if process.poll() is not None:
                    self._fail(f"the {name} process died (exit code {process.returncode})")
                    return

    def _fail(self, reason: str) -> None:
        """Fails every pending request and control call; refuses all later ones. The
        Scheduler, if it still runs, is told to abort them: nobody is left to take their
        outputs (after the Detokenizer died, it would decode for nobody)."""
        if self.failure is not None:
            return
        self.failure = reason
        for state in self.states.values():
            with contextlib.suppress(zmq.ZMQError):  # a closed socket: nothing to tell
                sent = self.to_scheduler.send(wire.encode(wire.AbortReq(state.rid)),
                                              flags=zmq.NOBLOCK)
                sent.add_done_callback(lambda done: done.exception())  # a full queue: dropped
            state.fail(reason)
        self.states.clear()
        for future in self.control_waiters.values():
            if not future.done():
                future.set_exception(RuntimeUnavailable(reason))
