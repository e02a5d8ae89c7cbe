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
the sampling step does not sample: the group steps them itself. While a beam search
runs, decode steps take the plain loop (a step's forks need the host).

The ``Scheduler`` composes typed components over one ``SchedulerState`` (the queues, the
running batch, what the next step reports): ``Admission`` (``admission.py``), ``Overlap``
(``overlap.py``), ``Handoffs`` (``handoffs.py``, disaggregation), ``BeamSearches``
(``beam_searches.py``), ``StepBatches`` (``step_batches.py``, the forward batches) and,
for sliding layers that keep only their window, ``WindowRelease`` (``window_release.py``);
it keeps the step's pipeline, the forward passes and retraction. With
``--speculative-algorithm``, ``SpeculativeDecode`` (``speculative_decode.py``) runs the
decode steps where some request has draft tokens to verify.
"""

from __future__ import annotations

import time

import torch

from radixlm.host_to_device import to_device
from radixlm.kernels.forward_batch import ForwardBatch
from radixlm.kv_cache.allocator import pages_for
from radixlm.runtime.disaggregation.decode_handoff import DecodeHandoff
from radixlm.runtime.disaggregation.prefill_handoff import PrefillHandoff
from radixlm.runtime.model_executor.model_runner import ModelRunner
from radixlm.runtime.request import Req, finish_abort
from radixlm.runtime.sampling.sampler import Sampler
from radixlm.runtime.scheduler.admission import Admission
from radixlm.runtime.scheduler.beam_searches import BeamSearches
from radixlm.runtime.scheduler.decode_worker import DecodeWorker
from radixlm.runtime.scheduler.grammar_queue import GrammarQueue
from radixlm.runtime.scheduler.handoffs import Handoffs
from radixlm.runtime.scheduler.overlap import Overlap
from radixlm.runtime.scheduler.prefill_adder import PrefillAdder
from radixlm.runtime.scheduler.prefill_pace import PrefillPace
from radixlm.runtime.scheduler.request_memory import RequestMemory
from radixlm.runtime.scheduler.sampling_step import SamplingStep
from radixlm.runtime.scheduler.scheduler_info import describe
from radixlm.runtime.scheduler.scheduler_state import SchedulerState
from radixlm.runtime.scheduler.speculative_decode import build_speculation
from radixlm.runtime.scheduler.step_batches import StepBatches
from radixlm.runtime.scheduler.window_release import WindowRelease
from radixlm.runtime.server_args import ServerArgs


class Scheduler:
    """Runs requests to completion over the runner's pools (the invariants between steps:
    ``SchedulerState``'s)."""

    def __init__(self, runner: ModelRunner, memory: RequestMemory,
                 sampling_step: SamplingStep, sampler: Sampler, args: ServerArgs,
                 prefill_handoff: PrefillHandoff | None = None,
                 decode_handoff: DecodeHandoff | None = None):
        """The hand-offs: on a prefill or a decode server (``handoffs.py``)."""
        self.runner = runner
        self.memory = memory
        self.sampling_step = sampling_step
        self.sampler = sampler
        self.args = args
        self.state = state = SchedulerState(sampler.new_batch(runner.device),
                                            args.init_new_token_ratio)
        self.grammar_queue = GrammarQueue(sampler.grammar_backend)
        step_ms = None if args.disable_adaptive_timing else args.chunked_prefill_step_ms
        self.prefill_pace = PrefillPace(args.chunked_prefill_size,
                                        None if step_ms is None else step_ms / 1000)
        self.batches = StepBatches(state, memory, runner)
        self.speculation = build_speculation(args, state, memory, runner, self.batches,
                                             sampling_step, sampler)
        worker = None
        if args.overlap_schedule():
            worker = DecodeWorker(runner, sampling_step, sampler, state.sampling_batch)
        self.overlap = Overlap(state, memory, sampling_step, args, self.batches, worker,
                               None if self.speculation is None
                               else self.speculation.wants_host)
        self.handoffs = Handoffs(state, memory, sampling_step, self.overlap.drain,
                                 prefill_handoff, decode_handoff,
                                 args.max_loras_per_batch if args.enable_lora else None)
        self.admission = Admission(state, memory, args, self.grammar_queue,
                                   self.prefill_pace, self.handoffs)
        self.beams = BeamSearches(state, memory, runner, sampling_step)
        self.windows = WindowRelease(state, memory) if memory.window is not None else None

    def check_adapter(self, req: Req) -> None:
        """ValueError unless the LoRA adapter ``req`` names (if any) may take requests."""
        if req.lora_name is None:
            return
        if self.runner.lora is None:
            raise ValueError("lora_path needs a server started with LoRA adapters "
                             "(--enable-lora or --lora-paths)")
        self.runner.lora.check(req.lora_name)

    def add_request(self, req: Req) -> None:
        """Queues ``req``; a constrained one waits for its grammar first (a failed
        grammar finishes it, reported at the next step). ``check_adapter`` first; a
        request on an adapter caches its KV in the adapter's own namespace (a prefix
        computed under one adapter serves no other)."""
        self.check_adapter(req)
        if req.lora_name is not None:
            req.extra_key = self.runner.lora.cache_namespace(req.lora_name, req.extra_key)
        self.sampling_step.prepare(req)
        if req.sampling.use_beam_search and not self.beams.join(req):
            return
        if req.handoff in ("send", "fake"):  # a prefill server's part ends at one token
            req.output_limit = min(req.output_limit, 1)
        if req.grammar_key is not None and req.grammar is None:
            if not self.grammar_queue.add(req):
                return
            if req.finished:
                self.state.to_report.append(req)
                return
        self.admission.enqueue(req)

    def shutdown(self) -> None:
        """Stops the threads the scheduler started (the decode worker, grammar compiles)
        and the model's other ranks."""
        if self.overlap.worker is not None:
            self.overlap.worker.shutdown()
        self.sampler.grammar_backend.shutdown()
        self.handoffs.close()
        if self.speculation is not None:
            self.speculation.close()
        close_cache = getattr(self.memory.tree_cache, "close", None)
        if close_cache is not None:
            close_cache()
        self.runner.close()

    def is_idle(self) -> bool:
        return not (self.has_work_to_run() or self.handoffs.busy())

    def has_work_to_run(self) -> bool:
        """Whether a step would compute or report something now (else it only waits: for
        requests, or for a peer server's KV messages)."""
        state = self.state
        return bool(state.waiting or state.running or state.chunked is not None
                    or self.grammar_queue or state.to_report or state.in_flight is not None)

    def requests(self) -> list[Req]:
        """Every request not yet finished."""
        state = self.state
        chunked = [state.chunked] if state.chunked is not None else []
        not_running = [m for r in state.waiting + chunked if r.beam is not None
                       for m in r.beam.members[1:]]  # a beam search's members, before it runs
        return (self.grammar_queue.reqs() + state.waiting + chunked + state.running
                + not_running + self.handoffs.reqs())

    def step(self) -> list[Req]:
        """One forward pass. Returns the requests that took part in it (with a decode step
        in flight: in the one before it), and those that ended or stepped since the last
        step outside one (failed grammars, hand-offs, a ``drain``). Then, with sliding
        layers that keep only their window, the KV out of the windows is freed."""
        stepped = self._step()
        if self.windows is not None:
            self.windows.after_step()
        lora = self.runner.lora
        if lora is not None and lora.retiring:  # unloaded adapters go once unused
            lora.purge({req.lora_name for req in self.requests() if req.lora_name})
        return stepped

    def load_lora_adapter(self, name: str, path: str) -> dict:
        """Registers the adapter at ``path`` as ``name`` (ValueError naming what is wrong)."""
        if self.runner.lora is None:
            raise ValueError("this server was started without LoRA adapters (--enable-lora)")
        adapter = self.runner.lora.register(name, path)
        return {"lora_name": name, "rank": adapter.rank,
                "target_modules": sorted(adapter.target_modules)}

    def unload_lora_adapter(self, name: str) -> dict:
        """Takes adapter ``name`` away from new requests (its unfinished ones keep it)."""
        if self.runner.lora is None:
            raise ValueError("this server was started without LoRA adapters (--enable-lora)")
        in_use = {req.lora_name for req in self.requests() if req.lora_name}
        return {"lora_name": name, "in_use": self.runner.lora.unregister(name, in_use)}

    def _step(self) -> list[Req]:
        state = self.state
        ended = self.handoffs.step() + self.admission.move_compiled() + state.take_reports()
        if state.in_flight is not None:
            return ended + self.overlap.step()
        if state.decode_owed and state.running:
            state.decode_owed = False  # a chunk ran last step: the running requests go now
            return ended + self._run_decode(self._retract_until_decode_fits())
        adder = self.admission.admit()
        if adder is not None and adder.reqs:
            stepped = self._run_extend(adder)
            state.decode_owed = state.chunked is not None
            return ended + stepped
        if state.running:
            return ended + self._run_decode(self._retract_until_decode_fits())
        if not ended:
            self.grammar_queue.wait()  # nothing to run until a grammar is ready
        return ended

    def drain(self) -> None:
        """Ends the decode step in flight, if any (``Overlap.drain``)."""
        self.overlap.drain()

    def abort(self, req: Req, message: str = "aborted", cache: bool = True) -> None:
        """Ends ``req`` at once, freeing its KV; a no-op for a finished request. A beam
        search's member ends its whole search (the caller reports every member).
        ``cache`` False (after a failed step, which may have left KV unwritten): a running
        request's own KV is freed, not cached."""
        if req.finished:
            return
        state = self.state
        self.overlap.drain()
        if req in state.to_report:  # the caller reports it now, with its end
            state.to_report.remove(req)
        if req.finished:  # with the step that was in flight
            return
        if req.beam is not None:
            self.beams.abort(req.beam, message)
        elif self.grammar_queue.remove(req) or self.handoffs.abort(req):
            pass
        elif req in state.waiting:
            state.waiting.remove(req)
        elif req is state.chunked or req in state.running:
            if req is state.chunked:
                state.chunked = None
            else:
                state.running.remove(req)
                state.sampling_batch.remove([req])
            if cache or req.beam is not None:  # (a beam group frees a failed step itself)
                self._release(req)
            else:
                self.memory.discard(req)
        req.finish_reason = finish_abort(message)

    def flush_cache(self) -> bool:
        """Empties the prefix cache (and restarts ``peak_kv_tokens``); False, doing
        nothing, while requests hold KV."""
        if not self.is_idle():
            return False
        self.memory.flush()
        self.state.peak_kv_tokens = 0
        return True

    def server_info(self) -> dict:
        """The pool, the cache and the queues, as plain data."""
        return describe(self)

    # Forward passes ----------------------------------------------------------------------

    def _run_extend(self, adder: PrefillAdder) -> list[Req]:
        state, reqs = self.state, adder.reqs
        new_ids = [r.all_ids()[r.kv_len : r.kv_len + n] for r, n in zip(reqs, adder.extend_lens)]
        state.chunked = adder.chunked_req
        state.running += [r for r in reqs if r is not state.chunked]
        state.stats.extend_steps += 1
        started = time.perf_counter()
        stepped = self._extend(reqs, new_ids, share_prefixes=True)
        if not self.runner.last_pass_was_trial:  # a trial's thread count is not the pace's
            self.prefill_pace.observe(sum(adder.extend_lens), time.perf_counter() - started)
        return stepped

    def _run_decode(self, pending: int) -> list[Req]:
        """One token for each running request, or, when jump-forward left some request
        several tokens without KV (``pending``, their total, exceeds one per request), an
        extend over every running request's pending tokens."""
        state, args = self.state, self.args
        reqs = list(state.running)
        state.stats.decode_steps += 1
        state.decay_new_token_ratio(args.new_token_ratio_decay, args.min_new_token_ratio)
        if pending == len(reqs):
            if self.speculation is not None:
                stepped = self.speculation.step(reqs)
                if stepped is not None:
                    return stepped
            if self.overlap.worker is not None and not state.beam_groups:
                state.in_flight = self.overlap.launch(reqs, previous=None)
                return []  # its tokens are processed at the next step
            started = time.perf_counter()
            stepped = self._run_and_process(reqs, self.batches.decode(reqs, known_inputs=True))
            if self.speculation is not None:  # what a verify step's rows are weighed against
                self.speculation.observe_plain_step(len(reqs), time.perf_counter() - started)
            return stepped
        state.stats.jump_forward_steps += 1
        pending = [r.output_ids[r.kv_len - len(r.input_ids):] for r in reqs]
        return self._extend(reqs, pending)

    def _extend(self, reqs: list[Req], new_ids: list[list[int]],
                share_prefixes: bool = False) -> list[Req]:
        """An extend step over ``reqs``' ``new_ids``. ``share_prefixes`` (admission
        extends): an unfinished request's prompt or chunk enters the radix cache at once,
        not only when the request ends."""
        prefix_lens = [r.kv_len for r in reqs]
        batch = self.batches.extend(reqs, new_ids)
        return self._run_and_process(reqs, batch, prefix_lens, share_prefixes)

    def _run_and_process(self, reqs: list[Req], batch: ForwardBatch,
                         prefix_lens: list[int] | None = None,
                         share_prefixes: bool = False) -> list[Req]:
        """Runs the model over ``batch`` (whose KV slots the requests already hold), samples,
        and releases the requests that finished. ``prefix_lens`` None: a decode step."""
        state = self.state
        hidden = self.runner.forward(batch)
        state.stats.forward_steps += 1
        state.note_kv_peak(self.memory)
        beam_rows = self.beams.rows(reqs, batch.extend_seq_lens_list
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
                finished = self.sampling_step.process_decode(
                    sampled, sampled_hidden, self.sampler, state.sampling_batch)
            for req in finished:
                state.running.remove(req)
                self.memory.release(req)
            state.sampling_batch.remove(finished)
            return reqs + self.beams.step(hidden, beam_rows)
        extend_lens = batch.extend_seq_lens_list
        self.sampling_step.process(reqs, hidden, prefix_lens, extend_lens, self.sampler,
                                      state.sampling_batch)
        finished = []
        for req, extend in zip(reqs, extend_lens):
            if req.finish_reason is not None:
                finished.append(req)
                if req is state.chunked:
                    state.chunked = None
                else:
                    state.running.remove(req)
                self.handoffs.release_ended_prefill(req)
            elif share_prefixes and extend > 1:
                self.memory.cache_unfinished(req)
        state.sampling_batch.remove(finished)
        return reqs + self.beams.step(hidden, beam_rows)

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
        state, page = self.state, self.memory.page_size
        while True:
            pending = sum(len(r.input_ids) + len(r.output_ids) - r.kv_len for r in state.running)
            need = pending
            if page > 1:  # (+ the pages a beam search's step may copy)
                need = sum(pages_for(r.seq_len, page) - pages_for(r.kv_len, page)
                           for r in state.running) + sum(g.width * page
                                                         for g in state.beam_groups)
            if need <= self.memory.available_tokens():
                return pending
            if state.chunked is not None:  # its prefill so far stays cached
                victim, state.chunked = state.chunked, None
            elif len(state.running) > 1:
                # The request that loses least progress and frees most memory.
                victim = min(state.running, key=lambda r: (len(r.output_ids), -len(r.input_ids)))
                if victim.beam is not None:  # its whole beam search goes
                    if len(victim.beam.members) == len(state.running):
                        return pending  # it alone always fits (the Engine checks)
                    victim = victim.beam.leader
                    self.beams.remove(victim.beam)
                else:
                    state.running.remove(victim)
            else:
                return pending  # one request always fits: the Engine refuses any that cannot
            self._release(victim)
            state.sampling_batch.remove([victim])
            victim.retractions += 1
            state.stats.retractions += 1
            state.waiting.insert(0, victim)
            state.new_token_ratio = 1.0
