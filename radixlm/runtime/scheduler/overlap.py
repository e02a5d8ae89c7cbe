"""Overlap scheduling: decode steps run on a worker thread, one step ahead of their processing.

Without overlap a decode step is strictly serial: build the batch, run the model, sample,
copy the tokens to the host, append them (stop checks), report them; the device idles while
the host works. With overlap, step N's forward pass and sampling run on the worker while
the host builds step N + 1 and then processes step N - 1's tokens:

    host:    build N+1 | wait N-1's tokens, append, report |  build N+2 | ...
    worker:  ... N                  | N+1 (queued behind N, fed N's tokens on the device)

Step N + 1 is built before step N's tokens are known on the host: its input tokens are
step N's sampled tokens, taken on the worker (no host round trip); its requests are step
N's minus those known to have finished (at step N - 1) or sure to finish with step N's
token (their output budget or the context ends there). A request that step N ends by a
stop token therefore runs one step too many; that step's token is discarded. Its KV
slot is allocated like any other and freed with the request, so no slot is lost.

The host's turn comes back for what a step ahead cannot do: admission (an extend step),
retraction, an abort, a step that may verify draft tokens (speculative decoding); the step
in flight is drained first and the plain loop runs.
Logprobs are computed on the worker with the tokens; seeds and ``min_new_tokens`` read the
positions the ``SamplingBatch`` records itself.

Constrained requests run ahead too. A grammar's mask for step N + 1 needs step N's token
accepted by its matcher, which the host does while step N + 1's forward pass runs: the
worker runs the forward pass, then waits for the host to have processed step N
(``host_ready``) before it masks and samples; the host leaves the matchers alone from then
until it has step N + 1's tokens. A request whose grammar forced more text after step N's
token (jump-forward) has those tokens without KV: its step N + 1 token is discarded (its
KV, for step N's token, is kept), the step after is not queued ahead, and the plain loop's
extend step computes the jumped tokens, as it would have without overlap.

On CUDA the host's inputs go from pinned memory without waiting, and each step's tokens
come back by a copy behind its kernels and an event, so the host never waits for the step
queued after it; on a CPU the worker runs while the host's Python does, as torch releases
the GIL inside its kernels.

Everything the sampler keeps (the ``SamplingBatch``) is touched only by the worker while
a step is in flight: rows of requests that left are removed at the start of the next
step's job, after the step that still sampled them. The host touches the allocator, the
prefix cache and ``req_to_token`` columns past those any queued step reads.
"""

from __future__ import annotations

from collections.abc import Callable

from radixlm.kv_cache.allocator import pages_for
from radixlm.runtime.request import Req
from radixlm.runtime.scheduler.decode_worker import DecodeInFlight, DecodeWorker
from radixlm.runtime.scheduler.request_memory import RequestMemory
from radixlm.runtime.scheduler.sampling_step import SamplingStep
from radixlm.runtime.scheduler.scheduler_state import SchedulerState
from radixlm.runtime.scheduler.step_batches import StepBatches
from radixlm.runtime.server_args import ServerArgs


class Overlap:
    """The scheduler's steps with a decode step in flight (``SchedulerState.in_flight``)."""

    def __init__(self, state: SchedulerState, memory: RequestMemory,
                 sampling_step: SamplingStep, args: ServerArgs, batches: StepBatches,
                 worker: DecodeWorker | None,
                 wants_host: Callable[[list[Req]], bool] | None = None):
        """``worker`` None: decode steps are never queued ahead (no overlap).
        ``wants_host``: whether the next decode step of these requests needs their
        tokens on the host first (speculative decoding's drafts are made from them)."""
        self.wants_host = wants_host
        self.state = state
        self.memory = memory
        self.sampling_step = sampling_step
        self.args = args
        self.batches = batches
        self.worker = worker

    def drain(self) -> None:
        """Waits for the decode step in flight, if any, and processes it: afterwards the
        sampling batch's rows are ``running`` again. What it produced is reported at the
        next step."""
        state = self.state
        if state.in_flight is None:
            return
        flight, state.in_flight = state.in_flight, None
        state.to_report += self._process_in_flight(flight)
        self._drop_finished_rows()

    def step(self) -> list[Req]:
        """Queues the next decode step behind the one in flight, unless something needs the
        host's turn first (admission, retraction, jumped tokens to compute), then processes
        the one in flight (and lets the queued step sample: ``host_ready``)."""
        state, args = self.state, self.args
        flight, state.in_flight = state.in_flight, None
        # Less those known to have ended, and those the token in flight ends by length.
        following = [r for r in flight.reqs
                     if r.finish_reason is None and len(r.output_ids) + 1 < r.output_limit]
        if (following and not flight.jumped and not state.waiting and state.chunked is None
                and self._decode_fits(following)
                and (self.wants_host is None or not self.wants_host(following))):
            state.stats.decode_steps += 1
            state.stats.overlapped_steps += 1
            state.decay_new_token_ratio(args.new_token_ratio_decay, args.min_new_token_ratio)
            state.in_flight = self.launch(following, previous=flight)
        try:
            stepped = self._process_in_flight(flight)
        finally:
            if state.in_flight is not None:
                state.in_flight.host_ready.set()
        if state.in_flight is None:
            self._drop_finished_rows()
        elif all(r.finished for r in state.in_flight.reqs):
            self.drain()  # every request of the queued step has ended: nothing to wait for
        return stepped

    def launch(self, reqs: list[Req], previous: DecodeInFlight | None) -> DecodeInFlight:
        """Queues the decode step of ``reqs`` on the worker (fed ``previous``'s tokens on
        the device, or, None, their last tokens)."""
        batch = self.batches.decode(reqs, known_inputs=previous is None)
        self.state.stats.forward_steps += 1
        self.state.note_kv_peak(self.memory)
        return self.worker.launch(reqs, batch, previous)

    def _process_in_flight(self, flight: DecodeInFlight) -> list[Req]:
        """Appends ``flight``'s tokens and ends the requests that finish with them; returns
        the requests it stepped (not those that had finished before it)."""
        state = self.state
        try:
            tokens, found = flight.host_outputs()
        except BaseException:
            if state.in_flight is not None:  # queued behind the failed one: it fails too
                state.in_flight.host_ready.set()
                state.in_flight.tokens.exception()
                state.in_flight = None
            raise
        reqs = flight.reqs
        if found is not None:  # (a request that jumps wants no logprobs)
            self.sampling_step.add_output_logprobs(
                [(reqs[row], i) for i, row in enumerate(flight.logprob_rows)
                 if not reqs[row].finished], found)
        if flight.jumped:  # their tokens are discarded (see the module)
            jumped = {id(req) for req in flight.jumped}
            rows = [row for row, req in enumerate(reqs) if id(req) not in jumped]
            reqs, tokens = [reqs[row] for row in rows], [tokens[row] for row in rows]
        stepped = [r for r in reqs if not r.finished]
        # The worker may own the sampling batch: jumped tokens are not recorded in it.
        jumped: list[Req] = []
        for req in self.sampling_step.append_tokens(reqs, tokens, None, jumped):
            state.running.remove(req)
            self.memory.release(req)
        if state.in_flight is not None:
            # The step queued behind computes only the KV of the token before their jumped
            # ones (an unfinished request that jumped is in it: nothing ended it by length).
            state.in_flight.jumped = jumped
        else:
            self._rejoin(flight.jumped + jumped)
        return stepped

    def _rejoin(self, jumped: list[Req]) -> None:
        """With nothing in flight: the sampling rows of requests that jumped (rows that
        lack the jumped tokens, or recorded a discarded one) are rebuilt from their outputs
        at the end of the batch, and the requests move to the end of ``running`` (rows and
        requests stay in one order)."""
        if not jumped:
            return
        state = self.state
        state.sampling_batch.remove(jumped)
        state.sampling_batch.add(jumped)
        for req in jumped:
            state.running.remove(req)
            state.running.append(req)

    def _drop_finished_rows(self) -> None:
        """With nothing in flight: the sampling rows of requests that have ended go (those
        a step ran ahead for, and those that ended with it)."""
        batch = self.state.sampling_batch
        batch.remove([r for r in batch.reqs if r.finished])

    def _decode_fits(self, reqs: list[Req]) -> bool:
        """Whether the pool holds a slot for each request's next token (else the plain
        loop's turn: it retracts)."""
        page = self.memory.page_size
        need = len(reqs) if page == 1 else sum(
            pages_for(r.kv_len + 1, page) - pages_for(r.kv_len, page) for r in reqs)
        return need <= self.memory.available_tokens()
