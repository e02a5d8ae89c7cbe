"""The scheduler's admission round: which waiting requests join the next extend step (the
budgets themselves are ``prefill_adder.py``'s, the order ``schedule_policy.py``'s)."""

from __future__ import annotations

from collections.abc import Iterator

from radixlm.kv_cache.base import MatchResult
from radixlm.runtime.request import Req
from radixlm.runtime.scheduler.prefill_adder import PrefillAdder, decode_reserve


class AdmissionSteps:
    """Mixed into ``Scheduler``: uses its ``memory``, ``args``, ``policy``, ``stats``,
    ``grammar_queue``, ``waiting``, ``running``, ``chunked``, ``new_token_ratio``,
    ``prefill_pace``, ``_failed``, ``_chunk_yielded`` and ``_enqueue``."""

    def _move_compiled(self) -> list[Req]:
        """Moves requests whose grammar is ready to the waiting queue; returns those whose
        grammar failed (finished)."""
        failed, self._failed = self._failed, []
        for req in self.grammar_queue.pop_done():
            if req.finished:
                failed.append(req)
            else:
                self._enqueue(req)
        return failed

    def _admit(self) -> PrefillAdder | None:
        """This step's admission round; None when there is nothing to admit (so a decode
        step costs nothing here)."""
        if self.chunked is None and not self.waiting:
            return None
        args = self.args
        adder = PrefillAdder(
            memory=self.memory,
            reserved=self._running_reserve(),
            prefill_tokens=args.max_prefill_tokens,
            chunk_tokens=self.prefill_pace.chunk_tokens(alone=self._prefills_alone()),
            rows=self.memory.req_to_token_pool.available_size(),
            new_token_ratio=self.new_token_ratio,
        )
        admit_new = not (args.batching == "static" and (self.running or self.chunked))
        if self.chunked is not None:
            if self.waiting and adder.rows and admit_new:
                adder.add_short_before_chunk(self.chunked, self._admissible(adder))
            if adder.new_reqs and not self._chunk_yielded:
                # Short prompts go alone (their wait: at most one chunk step), the chunk
                # next step; chunk steps and short ones alternate, so neither starves.
                self._chunk_yielded = True
                adder.chunked_req = self.chunked
            else:
                self._chunk_yielded = False
                admit_new = adder.add_chunked(self.chunked)  # else nothing overtakes it
        if admit_new and self.waiting and adder.rows and adder.chunked_req is None:
            for req, match in self._admissible(adder):
                if not adder.add_new(req, match):
                    break
        admitted = {id(r) for r in adder.new_reqs}
        self.waiting = [r for r in self.waiting if id(r) not in admitted]
        for req in adder.new_reqs:
            if req.beam is not None:
                req.beam.take_rows(self.memory)
            if not req.retractions:
                self.stats.prompt_tokens += len(req.input_ids)
                self.stats.cached_tokens += req.cached_tokens
        return adder

    def _prefills_alone(self) -> bool:
        """Nobody would wait behind this step's chunk: no request runs and the prompt being
        prefilled is the only one queued (its chunks may then be longer)."""
        return not self.running and len(self.waiting) + (self.chunked is not None) <= 1

    def _running_reserve(self) -> int:
        """KV slots the running requests hold back: their expected output, plus the jumped
        tokens (jump-forward) that have no KV yet."""
        ratio = self.new_token_ratio
        return sum(decode_reserve(r, ratio) + r.seq_len - r.kv_len - 1 for r in self.running)

    def _admissible(self, adder: PrefillAdder) -> Iterator[tuple[Req, MatchResult | None]]:
        """The waiting requests in policy order, but for those ``adder`` admitted already
        and samples whose leader's prompt is not cached yet (they reuse it once it is)."""
        admitted = {id(r) for r in adder.new_reqs}
        for req, match in self.policy.order(self.waiting):
            leader = req.prefill_leader
            if id(req) not in admitted and (
                    leader is None or leader.output_ids or leader.finished) and (
                    req.beam is None or req.beam.complete):
                yield req, match
