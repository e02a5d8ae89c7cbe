"""First-come continuous batching: each step either prefills newly admitted requests or decodes
every running one, and finished requests leave the batch at once.

Admission reserves, for every running request, KV for all the tokens it may still produce,
so a decode step never runs out of slots and nothing needs retracting. (The full scheduler
with chunked prefill, cache-aware policies and retraction replaces this policy; the step
structure stays.)
"""

from __future__ import annotations

from collections import deque

import torch

from radixlm.kernels.forward_batch import ForwardMode
from radixlm.runtime.model_runner import ModelRunner
from radixlm.runtime.output_processor import OutputProcessor
from radixlm.runtime.request import Req, finish_abort
from radixlm.runtime.sampler import Sampler


class Scheduler:
    """Runs requests to completion over the runner's pools.

    Invariant between steps: a running request holds a request row and the KV slots of its
    first ``kv_len`` tokens; waiting and finished requests hold neither.
    """

    def __init__(self, runner: ModelRunner, output_processor: OutputProcessor, sampler: Sampler,
                 max_prefill_tokens: int = 8192):
        self.runner = runner
        self.output_processor = output_processor
        self.sampler = sampler
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []

    def add_request(self, req: Req) -> None:
        self.waiting.append(req)

    def is_idle(self) -> bool:
        return not self.waiting and not self.running

    def step(self) -> list[Req]:
        """One forward pass. Returns the requests that produced output or finished in it."""
        admitted = self._admit()
        if admitted:
            return self._run_extend(admitted)
        if self.running:
            return self._run_decode()
        return []

    def abort(self, req: Req, message: str = "aborted") -> None:
        """Ends ``req`` at once, freeing its KV; a no-op for a finished request."""
        if req.finished:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
            self._release(req)
        req.finish_reason = finish_abort(message)
        req.final_text = req.detokenizer.text

    def _admit(self) -> list[Req]:
        allocator = self.runner.allocator
        rows = self.runner.req_to_token_pool.available_size()
        reserved = sum(self._tokens_still_needed(r) for r in self.running)
        budget = allocator.available_size() - reserved
        prefill_tokens = 0
        admitted: list[Req] = []
        while self.waiting and len(admitted) < rows:
            req = self.waiting[0]
            need = self._tokens_still_needed(req)
            new_tokens = req.seq_len - req.kv_len
            too_many = prefill_tokens + new_tokens > self.max_prefill_tokens and admitted
            if need > budget or too_many:
                break
            admitted.append(self.waiting.popleft())
            budget -= need
            prefill_tokens += new_tokens
        return admitted

    def _tokens_still_needed(self, req: Req) -> int:
        """KV slots ``req`` may still take: the rest of its prompt and of its output budget,
        rounded up to whole pages."""
        remaining_output = max(req.sampling.max_new_tokens - len(req.output_ids), 0)
        tokens = req.seq_len - req.kv_len + remaining_output
        page = self.runner.allocator.page_size
        return -(-tokens // page) * page + (page if page > 1 else 0)

    def _run_extend(self, reqs: list[Req]) -> list[Req]:
        runner = self.runner
        input_ids, positions, rows, prefix_lens, extend_lens, slots = [], [], [], [], [], []
        for req in reqs:
            req.req_pool_idx = runner.req_to_token_pool.alloc()
            new_ids = req.all_ids()[req.kv_len:]
            slots.append(self._alloc_slots(req, len(new_ids)))
            input_ids += new_ids
            positions += range(req.kv_len, req.kv_len + len(new_ids))
            rows.append(req.req_pool_idx)
            prefix_lens.append(req.kv_len)
            extend_lens.append(len(new_ids))
            req.kv_len += len(new_ids)
        batch = runner.make_forward_batch(
            ForwardMode.EXTEND, input_ids, positions, torch.cat(slots), rows,
            prefix_lens, extend_lens,
        )
        hidden = runner.forward(batch)
        self.running.extend(reqs)
        return self._process(reqs, hidden, prefix_lens, extend_lens)

    def _run_decode(self) -> list[Req]:
        reqs = list(self.running)
        slots = torch.cat([self._alloc_slots(req, 1) for req in reqs])
        prefix_lens = [req.kv_len for req in reqs]
        batch = self.runner.make_forward_batch(
            ForwardMode.DECODE, [req.output_ids[-1] for req in reqs], prefix_lens, slots,
            [req.req_pool_idx for req in reqs], prefix_lens, [1] * len(reqs),
        )
        for req in reqs:
            req.kv_len += 1
        hidden = self.runner.forward(batch)
        return self._process(reqs, hidden, prefix_lens, [1] * len(reqs))

    def _alloc_slots(self, req: Req, num_tokens: int) -> torch.Tensor:
        slots = self.runner.allocator.alloc_extend(req.last_slot, num_tokens)
        row = self.runner.req_to_token_pool.req_to_token[req.req_pool_idx]
        row[req.kv_len : req.kv_len + num_tokens] = slots
        if num_tokens:
            req.last_slot = int(slots[-1])
        return slots

    def _process(
        self, reqs: list[Req], hidden: torch.Tensor, prefix_lens: list[int], extend_lens: list[int]
    ) -> list[Req]:
        self.output_processor.process(reqs, hidden, prefix_lens, extend_lens, self.sampler)
        for req in reqs:
            if req.finished:
                self.running.remove(req)
                self._release(req)
        return reqs

    def _release(self, req: Req) -> None:
        pool = self.runner.req_to_token_pool
        self.runner.allocator.free(req.slots(pool.req_to_token))
        pool.free(req.req_pool_idx)
        req.req_pool_idx, req.kv_len, req.last_slot = None, 0, -1
