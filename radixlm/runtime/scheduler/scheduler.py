"""Iteration-level (continuous) batching with chunked prefill, cache-aware admission and
retraction.

Each step is one forward pass, either:
- an extend step: newly admitted requests (in the policy's order, under the
  ``PrefillAdder``'s budgets) and the chunked request's next chunk (cut to about
  ``chunked_prefill_step_ms``, ``prefill_pace.py``), each computing only what its cached
  prefix does not cover; or, when nothing can be admitted or a chunk ran last step,
- a decode step: one token for every running request. If the pool cannot hold that
  token for everyone, requests are retracted first (their KV handed to the cache, the
  requests re-queued at the front, recomputed later); a retracted request still finishes.

Admission reserves KV for running requests' expected output (``new_token_ratio`` times
their remaining budget). The ratio decays each decode step, so admission grows bolder
while nothing goes wrong, and jumps back to 1 after a retraction.

``batching="static"`` (for comparison) admits a batch only when nothing runs, and runs
it until its last request ends.

Constrained requests wait in the ``grammar_queue`` until their grammar has compiled (in a
thread pool), then join the waiting queue. After jump-forward decoding a running request
has several tokens without KV; a step where any request has more than one runs as an
extend over every running request's pending tokens instead of a decode.

With overlap scheduling (the default; ``overlap.py``), a decode step runs on a worker
thread while the next step is prepared and the previous one's tokens are processed: a
step then returns the requests of the decode step before it.

A beam search (``beam_groups.py``) is admitted as its leader, counting a row and a
reservation per beam; once its prompt is prefilled, its beams run as its members, which
the output processor does not sample: the group steps them itself. While a beam search
runs, decode steps take the plain loop (a step's forks need the host).
"""

from __future__ import annotations

import time

import torch

from radixlm.host_to_device import to_device
from radixlm.kernels.forward_batch import ForwardBatch, ForwardMode
from radixlm.kv_cache.allocator import pages_for
from radixlm.runtime.disaggregation.decode_handoff import DecodeHandoff
from radixlm.runtime.disaggregation.prefill_handoff import PrefillHandoff
from radixlm.runtime.model_executor.model_runner import ModelRunner
from radixlm.runtime.request import Req, finish_abort
from radixlm.runtime.sampling.sampler import Sampler
from radixlm.runtime.scheduler.admission_steps import AdmissionSteps
from radixlm.runtime.scheduler.beam_groups import BeamGroup
from radixlm.runtime.scheduler.beam_steps import BeamSteps
from radixlm.runtime.scheduler.grammar_queue import GrammarQueue
from radixlm.runtime.scheduler.handoff_steps import HandoffSteps
from radixlm.runtime.scheduler.output_processor import OutputProcessor
from radixlm.runtime.scheduler.overlap import (
    DecodeInFlight,
    DecodeWorker,
    OverlapSteps,
)
from radixlm.runtime.scheduler.prefill_adder import PrefillAdder
from radixlm.runtime.scheduler.prefill_pace import PrefillPace
from radixlm.runtime.scheduler.request_memory import RequestMemory
from radixlm.runtime.scheduler.schedule_policy import SchedulePolicy
from radixlm.runtime.scheduler.scheduler_info import SchedulerStats, describe
from radixlm.runtime.server_args import ServerArgs


class Scheduler(AdmissionSteps, OverlapSteps, HandoffSteps, BeamSteps):
    """Runs requests to completion over the runner's pools.

    Invariants between steps: ``running`` requests have computed their whole prompt and
    hold a row and the KV of all but their last token (all but their last jumped tokens
    and the sampled one before them, after a jump-forward); the ``chunked`` request (if
    any) holds a row and the KV of its first ``kv_len`` prompt tokens; waiting, finished
    and grammar-queued requests hold neither. ``sampling_batch`` holds a row for each
    ``running`` request, in the same order (the output processor adds a request's row when
    it first samples it; finishing, aborting and retracting remove it).

    While a decode step is in flight (``in_flight``), its requests hold the KV of all their
    tokens and the slot of the one it computes, the host has not yet appended its tokens,
    and ``sampling_batch`` is the worker's (its rows: the step's requests); ``drain`` ends
    that state.
    """

    def __init__(self, runner: ModelRunner, memory: RequestMemory,
                 output_processor: OutputProcessor, sampler: Sampler, args: ServerArgs,
                 prefill_handoff: PrefillHandoff | None = None,
                 decode_handoff: DecodeHandoff | None = None):
        """The handoffs: on a prefill or a decode server (``handoff_steps.py``)."""
        self.runner = runner
        self.memory = memory
        self.output_processor = output_processor
        self.sampler = sampler
        self.sampling_batch = sampler.new_batch(runner.device)
        self.args = args
        self.prefill_handoff, self.decode_handoff = prefill_handoff, decode_handoff
        self.policy = SchedulePolicy(args.schedule_policy, memory.tree_cache, args.random_seed)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.new_token_ratio = args.init_new_token_ratio
        self.stats = SchedulerStats()
        self.grammar_queue = GrammarQueue(sampler.grammar_backend)
        self._failed: list[Req] = []  # grammar failures to report at the next step
        self.decode_worker = None
        if args.overlap_schedule():
            self.decode_worker = DecodeWorker(runner, output_processor, sampler,
                                              self.sampling_batch)
        self.in_flight: DecodeInFlight | None = None
        self._drained: list[Req] = []  # processed outside a step, to report at the next
        step_ms = args.chunked_prefill_step_ms
        self.prefill_pace = PrefillPace(args.chunked_prefill_size,
                                        None if step_ms is None else step_ms / 1000)
        self._decode_owed = False
        """A chunk of a long prompt ran last step: the running requests decode before the
        next one (a long prefill delays them by one chunk at a time, not by all of it)."""
        self._chunk_yielded = False
        """The last admission ran short prompts instead of the chunked prompt's chunk."""
        self.peak_kv_tokens = 0
        """The most KV slots in use at once (cached ones included) since the start or the
        last ``flush_cache``."""
        self.beam_groups: list[BeamGroup] = []
        """Beam searches past their prompt: all their members are in ``running``."""

    def add_request(self, req: Req) -> None:
        """Queues ``req``; a constrained one waits for its grammar first (a failed
        grammar finishes it, reported at the next step)."""
        self.output_processor.prepare(req)
        if req.sampling.use_beam_search and not self._join_beam_search(req):
            return
        if req.handoff in ("send", "fake"):  # a prefill server's part ends at one token
            req.output_limit = min(req.output_limit, 1)
        if req.grammar_key is not None and req.grammar is None:
            if not self.grammar_queue.add(req):
                return
            if req.finished:
                self._failed.append(req)
                return
        self._enqueue(req)

    def shutdown(self) -> None:
        """Stops the threads the scheduler started (the decode worker, grammar compiles)
        and the model's other ranks."""
        if self.decode_worker is not None:
            self.decode_worker.shutdown()
        self.sampler.grammar_backend.shutdown()
        self._close_handoffs()
        self.runner.close()

    def is_idle(self) -> bool:
        return not (self.has_work_to_run() or self._handing_off())

    def has_work_to_run(self) -> bool:
        """Whether a step would compute or report something now (else it only waits: for
        requests, or for a peer server's KV messages)."""
        return bool(self.waiting or self.running or self.chunked is not None
                    or self.grammar_queue or self._failed or self.in_flight is not None
                    or self._drained)

    def requests(self) -> list[Req]:
        """Every request not yet finished."""
        chunked = [self.chunked] if self.chunked is not None else []
        not_running = [m for r in self.waiting + chunked if r.beam is not None
                       for m in r.beam.members[1:]]  # a beam search's members, before it runs
        return (self.grammar_queue.reqs() + self.waiting + chunked + self.running
                + not_running + self._handoff_reqs())

    def step(self) -> list[Req]:
        """One forward pass. Returns the requests that took part in it (with a decode step
        in flight: in the one before it), those whose grammar failed to compile (now
        finished) and those a ``drain`` processed since the last step."""
        handed = []
        if self.prefill_handoff is not None or self.decode_handoff is not None:
            handed = self._step_handoffs()
        ended = handed + self._move_compiled() + self._drained
        self._drained = []
        if self.in_flight is not None:
            return ended + self._step_overlapped()
        if self._decode_owed and self.running:
            self._decode_owed = False  # a chunk ran last step: the running requests go now
            return ended + self._run_decode(self._retract_until_decode_fits())
        adder = self._admit()
        if adder is not None and adder.reqs:
            stepped = self._run_extend(adder)
            self._decode_owed = self.chunked is not None
            return ended + stepped
        if self.running:
            pending = self._retract_until_decode_fits()
            return ended + self._run_decode(pending)
        if not ended:
            self.grammar_queue.wait()  # nothing to run until a grammar is ready
        return ended

    def abort(self, req: Req, message: str = "aborted") -> None:
        """Ends ``req`` at once, freeing its KV; a no-op for a finished request. A beam
        search's member ends its whole search (the caller reports every member)."""
        if req.finished:
            return
        self.drain()
        if req in self._drained:  # the caller reports it now, with its end
            self._drained.remove(req)
        if req.finished:  # with the step that was in flight
            return
        if req.beam is not None:
            self._abort_beam_search(req.beam, message)
        elif self.grammar_queue.remove(req) or self._abort_handoff(req):
            pass
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req is self.chunked or req in self.running:
            if req is self.chunked:
                self.chunked = None
            else:
                self.running.remove(req)
                self.sampling_batch.remove([req])
            self._release(req)
        req.finish_reason = finish_abort(message)

    def flush_cache(self) -> bool:
        """Empties the prefix cache (and restarts ``peak_kv_tokens``); False, doing
        nothing, while requests hold KV."""
        if not self.is_idle():
            return False
        self.memory.flush()
        self.peak_kv_tokens = 0
        return True

    def server_info(self) -> dict:
        """The pool, the cache and the queues, as plain data."""
        return describe(self)

    # Forward passes ----------------------------------------------------------------------

    def _run_extend(self, adder: PrefillAdder) -> list[Req]:
        reqs = adder.reqs
        new_ids = [r.all_ids()[r.kv_len : r.kv_len + n] for r, n in zip(reqs, adder.extend_lens)]
        self.chunked = adder.chunked_req
        self.running += [r for r in reqs if r is not self.chunked]
        self.stats.extend_steps += 1
        started = time.perf_counter()
        stepped = self._extend(reqs, new_ids, share_prefixes=True)
        if not self.runner.last_pass_was_trial:  # a trial's thread count is not the pace's
            self.prefill_pace.observe(sum(adder.extend_lens), time.perf_counter() - started)
        return stepped

    def _run_decode(self, pending: int) -> list[Req]:
        """One token for each running request, or, when jump-forward left some request
        several tokens without KV (``pending``, their total, exceeds one per request), an
        extend over every running request's pending tokens."""
        reqs = list(self.running)
        self.stats.decode_steps += 1
        self.new_token_ratio = max(
            self.new_token_ratio - self.args.new_token_ratio_decay, self.args.min_new_token_ratio
        )
        if pending == len(reqs):
            if self.decode_worker is not None and not self.beam_groups:
                self.in_flight = self._launch(reqs, previous=None)
                return []  # its tokens are processed at the next step
            return self._decode(reqs)
        self.stats.jump_forward_steps += 1
        pending = [r.output_ids[r.kv_len - len(r.input_ids):] for r in reqs]
        return self._extend(reqs, pending)

    def _decode(self, reqs: list[Req]) -> list[Req]:
        """A decode step: each request's last token is its one new token."""
        return self._run_and_process(reqs, self._decode_batch(reqs, known_inputs=True))

    def _decode_batch(self, reqs: list[Req], known_inputs: bool) -> ForwardBatch:
        """Allocates a slot for each request's next token and builds the decode batch;
        ``known_inputs`` False: the input tokens are left for the worker to fill in."""
        kv_lens = [r.kv_len for r in reqs]
        input_ids = [r.output_ids[-1] for r in reqs] if known_inputs else [0] * len(reqs)
        inputs = self.runner.decode_inputs(input_ids, kv_lens, [r.req_pool_idx for r in reqs])
        _, positions, rows = inputs.unbind(0)
        slots = self.memory.alloc_decode(reqs, rows, positions)
        for req in reqs:
            req.kv_len += 1
        shared = self._shared_prefixes(reqs) if self.beam_groups else None
        return self.runner.make_decode_batch(inputs, slots, kv_lens, shared)

    def _extend(self, reqs: list[Req], new_ids: list[list[int]],
                share_prefixes: bool = False) -> list[Req]:
        """An extend step: allocates KV for each request's new tokens, runs the model,
        processes the output.

        A request's ``kv_len`` advances as soon as its slots are allocated, so that if a
        later allocation or the forward pass fails, aborting the requests frees everything.
        ``share_prefixes`` (admission extends): an unfinished request's prompt or chunk
        enters the radix cache at once, not only when the request ends.
        """
        input_ids, positions, slots, prefix_lens, extend_lens = [], [], [], [], []
        for req, ids in zip(reqs, new_ids):
            slots.append(self.memory.alloc(req, len(ids)))
            input_ids += ids
            positions += range(req.kv_len, req.kv_len + len(ids))
            prefix_lens.append(req.kv_len)
            extend_lens.append(len(ids))
            req.kv_len += len(ids)
        batch = self.runner.make_forward_batch(
            ForwardMode.EXTEND, input_ids, positions, torch.cat(slots),
            [r.req_pool_idx for r in reqs],
            prefix_lens, extend_lens,
        )
        return self._run_and_process(reqs, batch, prefix_lens, share_prefixes)

    def _run_and_process(self, reqs: list[Req], batch: ForwardBatch,
                         prefix_lens: list[int] | None = None,
                         share_prefixes: bool = False) -> list[Req]:
        """Runs the model over ``batch`` (whose KV slots the requests already hold), samples,
        and releases the requests that finished. ``prefix_lens`` None: a decode step."""
        hidden = self.runner.forward(batch)
        self.stats.forward_steps += 1
        self._note_kv_peak()
        beam_rows = self._beam_rows(reqs, batch.extend_seq_lens_list
                                    if prefix_lens is not None else None)
        if prefix_lens is None:  # only the requests that end need anything more
            sampled, sampled_hidden = reqs, hidden
            if beam_rows:  # the beams' rows are the groups' to step
                plain = [row for row, req in enumerate(reqs) if req.beam is None]
                sampled = [reqs[row] for row in plain]
                sampled_hidden = hidden.index_select(0, to_device(plain, torch.int64,
                                                                  hidden.device))
            finished = []
            if sampled:
                finished = self.output_processor.process_decode(
                    sampled, sampled_hidden, self.sampler, self.sampling_batch)
            for req in finished:
                self.running.remove(req)
                self.memory.release(req)
            self.sampling_batch.remove(finished)
            return reqs + self._step_beams(hidden, beam_rows)
        extend_lens = batch.extend_seq_lens_list
        self.output_processor.process(reqs, hidden, prefix_lens, extend_lens, self.sampler,
                                      self.sampling_batch)
        finished = []
        for req, extend in zip(reqs, extend_lens):
            if req.finish_reason is not None:
                finished.append(req)
                if req is self.chunked:
                    self.chunked = None
                else:
                    self.running.remove(req)
                self._release_ended_prefill(req)
            elif share_prefixes and extend > 1:
                self.memory.cache_unfinished(req)
        self.sampling_batch.remove(finished)
        return reqs + self._step_beams(hidden, beam_rows)

    def _note_kv_peak(self) -> None:
        used = self.memory.allocator.size - self.memory.allocator.available_size()
        self.peak_kv_tokens = max(self.peak_kv_tokens, used)

    def _release(self, req: Req) -> None:
        """Frees what a running or chunked request holds (a beam search: its group's)."""
        if req.beam is not None:
            req.beam.release(self.memory)
        else:
            self.memory.release(req)

    # Retraction --------------------------------------------------------------------------

    def _retract_until_decode_fits(self) -> int:
        """Retracts running requests until every remaining one can store its pending tokens
        (its last one, and any jumped ones); returns their number, over all requests."""
        page = self.memory.page_size
        while True:
            pending = sum(len(r.input_ids) + len(r.output_ids) - r.kv_len for r in self.running)
            need = pending
            if page > 1:  # (+ the pages a beam search's step may copy)
                need = sum(pages_for(r.seq_len, page) - pages_for(r.kv_len, page)
                           for r in self.running) + sum(g.width * page for g in self.beam_groups)
            if need <= self.memory.available_tokens():
                return pending
            if self.chunked is not None:  # its prefill so far stays cached
                victim, self.chunked = self.chunked, None
            elif len(self.running) > 1:
                # The request that loses least progress and frees most memory.
                victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.input_ids)))
                if victim.beam is not None:  # its whole beam search goes
                    if len(victim.beam.members) == len(self.running):
                        return pending  # it alone always fits (the Engine checks)
                    victim = victim.beam.leader
                    self._remove_beams(victim.beam)
                else:
                    self.running.remove(victim)
            else:
                return pending  # one request always fits: the Engine refuses any that cannot
            self._release(victim)
            self.sampling_batch.remove([victim])
            victim.retractions += 1
            self.stats.retractions += 1
            self.waiting.insert(0, victim)
            self.new_token_ratio = 1.0
