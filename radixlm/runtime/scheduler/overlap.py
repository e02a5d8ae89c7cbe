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
retraction, an abort; the step in flight is drained first and the plain loop runs.
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

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from radixlm.host_to_device import to_device
from radixlm.kernels.forward_batch import ForwardBatch
from radixlm.kv_cache.allocator import pages_for
from radixlm.runtime.request import Req
from radixlm.runtime.sampling.logprobs import Logprobs
from radixlm.runtime.sampling.sampler import Sampler
from radixlm.runtime.sampling.sampling_batch import GRAMMAR, SamplingBatch


@dataclass
class DecodeInFlight:
    """A decode step queued on or running on the worker."""

    reqs: list[Req]
    """Its requests, in the sampling batch's row order when it samples."""
    logprob_rows: list[int] = field(default_factory=list)
    """The rows of the requests that want their tokens' logprobs."""
    host_ready: threading.Event = field(default_factory=threading.Event)
    """Set once the host has processed the step before (its matchers have accepted that
    step's tokens): a step with grammars samples only then."""
    jumped: list[Req] = field(default_factory=list)
    """Requests that jump-forward extended after this step was queued: its tokens for them
    are discarded, and no step is queued behind it."""
    tokens: Future = field(default_factory=Future)
    """Resolves to the sampled tokens, (len(reqs),) int64 on the device, a function
    returning them as a list (see ``_start_copy_to_host``) and the ``Logprobs`` of
    ``logprob_rows`` (None without any)."""

    def host_outputs(self) -> tuple[list[int], Logprobs | None]:
        """Waits for this step's tokens (only: not for steps queued after it) and logprobs."""
        _, read, found = self.tokens.result()
        return read(), found


class DecodeWorker:
    """Runs decode steps' forward passes and sampling in order on one worker thread."""

    def __init__(self, runner, output_processor, sampler: Sampler,
                 sampling_batch: SamplingBatch):
        """``runner.forward(batch) -> hidden`` and ``output_processor.compute_logits(hidden)
        -> logits`` are looked up at each step (a benchmark's stand-ins replace them)."""
        self.runner = runner
        self.output_processor = output_processor
        self.sampler = sampler
        self.sampling_batch = sampling_batch
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="radixlm-decode")

    def launch(self, reqs: list[Req], batch: ForwardBatch,
               previous: DecodeInFlight | None) -> DecodeInFlight:
        """Queues the decode of ``reqs`` (whose KV slots ``batch`` holds).

        ``previous``: the step in flight whose tokens are this step's inputs; ``reqs`` are
        its requests in order, less some (their sampling rows are dropped first). None:
        ``batch.input_ids`` already holds the inputs.
        """
        keep, leaving = None, []
        if previous is not None and len(reqs) < len(previous.reqs):
            staying = {id(req) for req in reqs}
            rows = [row for row, req in enumerate(previous.reqs) if id(req) in staying]
            keep = to_device(rows, torch.int64, batch.input_ids.device)
            leaving = [req for req in previous.reqs if id(req) not in staying]
        step = DecodeInFlight(reqs, [row for row, r in enumerate(reqs) if r.logprobs is not None])
        if previous is None:
            step.host_ready.set()
        top_k = max((reqs[row].logprobs.top_k for row in step.logprob_rows), default=0)
        step.tokens = self._thread.submit(self._run, batch, previous, keep, leaving,
                                          step.logprob_rows, top_k, step.host_ready)
        return step

    def shutdown(self) -> None:
        """Stops the worker thread once its queued steps have run."""
        self._thread.shutdown(wait=True)

    def _run(self, batch: ForwardBatch, previous: DecodeInFlight | None,
             keep: torch.Tensor | None, leaving: list[Req], logprob_rows: list[int],
             top_k: int, host_ready: threading.Event,
             ) -> tuple[torch.Tensor, Callable[[], list[int]], Logprobs | None]:
        if leaving:
            self.sampling_batch.remove(leaving)
        if previous is not None:
            tokens, *_ = previous.tokens.result()  # done: this thread ran it
            batch.input_ids = tokens if keep is None else tokens.index_select(0, keep)
        hidden = self.runner.forward(batch)
        logits = self.output_processor.compute_logits(hidden)  # (B, V)
        if self.sampling_batch.uses(GRAMMAR):
            host_ready.wait()  # the matchers have accepted the previous step's tokens
        next_ids = self.sampler.sample(logits, self.sampling_batch)  # (B,)
        self.sampling_batch.record_sampled(next_ids)
        found = None
        if logprob_rows:  # on this thread: the host does not wait for the copy
            rows = to_device(logprob_rows, torch.int64, logits.device)
            found = Logprobs.compute(logits.index_select(0, rows), next_ids.index_select(0, rows),
                                     top_k)
        return next_ids, _start_copy_to_host(next_ids), found


def _start_copy_to_host(tokens: torch.Tensor) -> Callable[[], list[int]]:
    """Starts copying ``tokens`` to the host and returns what waits for that copy. On CUDA
    the copy goes into pinned memory behind the step's kernels, and the wait is on an
    event recorded after it: the next step's kernels, queued later, are not waited for."""
    if tokens.device.type != "cuda":
        return tokens.tolist
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def read() -> list[int]:
        copied.synchronize()
        return host.tolist()

    return read


class OverlapSteps:
    """The ``Scheduler``'s steps with a decode step in flight (a part of it kept here).

    Uses the scheduler's ``running``, ``waiting``, ``chunked``, ``memory``, ``runner``,
    ``output_processor``, ``sampling_batch``, ``stats``, ``args`` and ``new_token_ratio``,
    its ``decode_worker`` and ``in_flight``, ``_drained`` (requests processed outside a
    step, reported at the next), ``_decode_batch(reqs, known_inputs)`` and
    ``_note_kv_peak()``.
    """

    def drain(self) -> None:
        """Waits for the decode step in flight, if any, and processes it: afterwards the
        sampling batch's rows are ``running`` again. What it produced is reported at the
        next step."""
        if self.in_flight is None:
            return
        flight, self.in_flight = self.in_flight, None
        self._drained += self._process_in_flight(flight)
        self._drop_finished_rows()

    def _step_overlapped(self) -> list[Req]:
        """Queues the next decode step behind the one in flight, unless something needs the
        host's turn first (admission, retraction, jumped tokens to compute), then processes
        the one in flight (and lets the queued step sample: ``host_ready``)."""
        flight, self.in_flight = self.in_flight, None
        # Less those known to have ended, and those the token in flight ends by length.
        following = [r for r in flight.reqs
                     if r.finish_reason is None and len(r.output_ids) + 1 < r.output_limit]
        if (following and not flight.jumped and not self.waiting and self.chunked is None
                and self._decode_fits(following)):
            self.stats.decode_steps += 1
            self.stats.overlapped_steps += 1
            self.new_token_ratio = max(self.new_token_ratio - self.args.new_token_ratio_decay,
                                       self.args.min_new_token_ratio)
            self.in_flight = self._launch(following, previous=flight)
        try:
            stepped = self._process_in_flight(flight)
        finally:
            if self.in_flight is not None:
                self.in_flight.host_ready.set()
        if self.in_flight is None:
            self._drop_finished_rows()
        elif all(r.finished for r in self.in_flight.reqs):
            self.drain()  # every request of the queued step has ended: nothing to wait for
        return stepped

    def _launch(self, reqs: list[Req], previous: DecodeInFlight | None) -> DecodeInFlight:
        batch = self._decode_batch(reqs, known_inputs=previous is None)
        self.stats.forward_steps += 1
        self._note_kv_peak()
        return self.decode_worker.launch(reqs, batch, previous)

    def _process_in_flight(self, flight: DecodeInFlight) -> list[Req]:
        """Appends ``flight``'s tokens and ends the requests that finish with them; returns
        the requests it stepped (not those that had finished before it)."""
        try:
            tokens, found = flight.host_outputs()
        except BaseException:
            if self.in_flight is not None:  # queued behind the failed one: it fails too
                self.in_flight.host_ready.set()
                self.in_flight.tokens.exception()
                self.in_flight = None
            raise
        reqs = flight.reqs
        if found is not None:  # (a request that jumps wants no logprobs)
            self.output_processor.add_output_logprobs(
                [(reqs[row], i) for i, row in enumerate(flight.logprob_rows)
                 if not reqs[row].finished], found)
        if flight.jumped:  # their tokens are discarded (see the module)
            jumped = {id(req) for req in flight.jumped}
            rows = [row for row, req in enumerate(reqs) if id(req) not in jumped]
            reqs, tokens = [reqs[row] for row in rows], [tokens[row] for row in rows]
        stepped = [r for r in reqs if not r.finished]
        # The worker may own the sampling batch: jumped tokens are not recorded in it.
        jumped: list[Req] = []
        for req in self.output_processor.append_tokens(reqs, tokens, None, jumped):
            self.running.remove(req)
            self.memory.release(req)
        if self.in_flight is not None:
            # The step queued behind computes only the KV of the token before their jumped
            # ones (an unfinished request that jumped is in it: nothing ended it by length).
            self.in_flight.jumped = jumped
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
        self.sampling_batch.remove(jumped)
        self.sampling_batch.add(jumped)
        for req in jumped:
            self.running.remove(req)
            self.running.append(req)

    def _drop_finished_rows(self) -> None:
        """With nothing in flight: the sampling rows of requests that have ended go (those
        a step ran ahead for, and those that ended with it)."""
        self.sampling_batch.remove([r for r in self.sampling_batch.reqs if r.finished])

    def _decode_fits(self, reqs: list[Req]) -> bool:
        """Whether the pool holds a slot for each request's next token (else the plain
        loop's turn: it retracts)."""
        page = self.memory.page_size
        need = len(reqs) if page == 1 else sum(
            pages_for(r.kv_len + 1, page) - pages_for(r.kv_len, page) for r in reqs)
        return need <= self.memory.available_tokens()
