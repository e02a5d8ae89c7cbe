"""The scheduler's admission round: which waiting requests join the next extend step (the
budgets themselves are ``prefill_adder.py``'s, the order ``schedule_policy.py``'s), and where
a request goes once it may run."""

from __future__ import annotations

from collections.abc import Iterator

from radixlm.kv_cache.base import MatchResult
from radixlm.runtime.request import Req
from radixlm.runtime.scheduler.grammar_queue import GrammarQueue
from radixlm.runtime.scheduler.handoffs import Handoffs
from radixlm.runtime.scheduler.prefill_adder import PrefillAdder
from radixlm.runtime.scheduler.prefill_pace import PrefillPace
from radixlm.runtime.scheduler.request_memory import RequestMemory
from radixlm.runtime.scheduler.schedule_policy import SchedulePolicy
from radixlm.runtime.scheduler.scheduler_state import SchedulerState
from radixlm.runtime.server_args import ServerArgs


class Admission:
    """Moves requests from the grammar queue to the waiting queue (or a decode server's
    hand-off), and from there into extend steps."""

    def __init__(self, state: SchedulerState, memory: RequestMemory, args: ServerArgs,
                 grammar_queue: GrammarQueue, prefill_pace: PrefillPace, handoffs: Handoffs):
        self.state = state
        self.memory = memory
        self.args = args
        self.policy = SchedulePolicy(args.schedule_policy, memory.tree_cache, args.random_seed)
        self.grammar_queue = grammar_queue
        self.prefill_pace = prefill_pace
        self.handoffs = handoffs
        self.slot_waiter: str | None = None
        """This round, the adapter of the oldest waiting request whose adapter the running
        batch lacks: the next adapter slot is its."""
        self.slots_full = False
        self.running_adapters: set[str] = set()

    def enqueue(self, req: Req) -> None:
        """Where a request goes once it may run: the decode hand-off for a paired request
        on a decode server (unless it wants no output), else the waiting queue."""
        if req.handoff == "receive" and req.sampling.max_new_tokens > 0:
            if not self.handoffs.receive(req):
                self.state.to_report.append(req)  # it failed: reported at the next step
        else:
            req.kv_prefetch = self.memory.tree_cache.prefetch(req.match_key(), req.extra_key)
            self.state.waiting.append(req)

    def move_compiled(self) -> list[Req]:
        """Moves requests whose grammar is ready to the waiting queue; returns those whose
        grammar failed (finished)."""
        failed = []
        for req in self.grammar_queue.pop_done():
            if req.finished:
                failed.append(req)
            else:
                self.enqueue(req)
        return failed

    def admit(self) -> PrefillAdder | None:
        """This step's admission round; None when there is nothing to admit (so a decode
        step costs nothing here)."""
        state, args = self.state, self.args
        if state.chunked is None and not state.waiting:
            return None
        adder = PrefillAdder(
            memory=self.memory,
            reserved=state.running_reserve(),
            prefill_tokens=args.max_prefill_tokens,
            chunk_tokens=self.prefill_pace.chunk_tokens(alone=self._prefills_alone()),
            rows=self.memory.req_to_token_pool.available_size(),
            new_token_ratio=state.new_token_ratio,
        )
        self.slot_waiter, self.slots_full = None, False
        if args.enable_lora:  # the running batch's adapters, and room for the others
            adder.adapters = {r.lora_name for r in [*state.running, state.chunked]
                              if r is not None and r.lora_name}
            adder.max_adapters = args.max_loras_per_batch
            self.running_adapters = set(adder.adapters)
            self.slots_full = len(adder.adapters) >= adder.max_adapters
            self.slot_waiter = next((r.lora_name for r in state.waiting if r.lora_name
                                     and r.lora_name not in adder.adapters), None)
        admit_new = not (args.batching == "static" and (state.running or state.chunked))
        if state.chunked is not None:
            if state.waiting and adder.rows and admit_new:
                adder.add_short_before_chunk(state.chunked, self._admissible(adder))
            if adder.new_reqs and not state.chunk_yielded:
                # Short prompts go alone (their wait: at most one chunk step), the chunk
                # next step; chunk steps and short ones alternate, so neither starves.
                state.chunk_yielded = True
                adder.chunked_req = state.chunked
            else:
                state.chunk_yielded = False
                admit_new = adder.add_chunked(state.chunked)  # else nothing overtakes it
        if admit_new and state.waiting and adder.rows and adder.chunked_req is None:
            for req, match in self._admissible(adder):
                if not adder.add_new(req, match):
                    break
        admitted = {id(r) for r in adder.new_reqs}
        state.waiting = [r for r in state.waiting if id(r) not in admitted]
        for req in adder.new_reqs:
            if req.beam is not None:
                req.beam.take_rows(self.memory)
            if not req.retractions:
                state.stats.prompt_tokens += len(req.input_ids)
                state.stats.cached_tokens += req.cached_tokens
        return adder

    def _waits_for_the_slot_waiter(self, req: Req) -> bool:
        """Whether ``req`` must let the slot waiter's adapter in first: another adapter the
        batch lacks (it would take the slot), or, while every slot is taken, any adapter
        but the waiter's (so the batch drains of them)."""
        name, waiter = req.lora_name, self.slot_waiter
        if name is None or waiter is None or name == waiter:
            return False
        return self.slots_full or name not in self.running_adapters

    def _prefills_alone(self) -> bool:
        """Nobody would wait behind this step's chunk: no request runs and the prompt being
        prefilled is the only one queued (its chunks may then be longer)."""
        state = self.state
        return not state.running and len(state.waiting) + (state.chunked is not None) <= 1

    def _admissible(self, adder: PrefillAdder) -> Iterator[tuple[Req, MatchResult | None]]:
        """The waiting requests in policy order, but for those ``adder`` admitted already,
        samples whose leader's prompt is not cached yet (they reuse it once it is), those
        whose prompt's KV is still being read from disk, and those that must let the
        oldest request on an adapter the batch lacks have the next adapter slot first
        (``_waits_for_the_slot_waiter``): no adapter starves behind others whose requests
        keep coming (and sort first by their cached prefixes)."""
        admitted = {id(r) for r in adder.new_reqs}
        for req, match in self.policy.order(self.state.waiting):
            leader = req.prefill_leader
            if req.kv_prefetch is not None:
                if not req.kv_prefetch.done():
                    continue
                req.kv_prefetch = None
            if self._waits_for_the_slot_waiter(req):
                continue
            if id(req) not in admitted and (
                    leader is None or leader.output_ids or leader.finished) and (
                    req.beam is None or req.beam.complete):
                yield req, match
