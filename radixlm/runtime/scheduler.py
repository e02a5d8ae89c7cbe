"""First-come continuous batching: each step either prefills newly admitted requests or decodes
every running one, and finished requests leave the batch at once.

A request is admitted with its longest cached prefix (which it then does not compute).
Admission reserves, for every running request, KV for all the tokens it may still produce,
counting what the prefix cache could evict as available, so a decode step never runs out
of slots and nothing needs retracting. (The full scheduler with chunked prefill,
cache-aware policies and retraction replaces this policy; the step structure stays.)
"""

from __future__ import annotations

from collections import deque

import torch

from radixlm.kernels.forward_batch import ForwardMode
from radixlm.runtime.model_runner import ModelRunner
from radixlm.runtime.output_processor import OutputProcessor
from radixlm.runtime.request import Req, finish_abort
from radixlm.runtime.request_memory import RequestMemory
from radixlm.runtime.sampler import Sampler


class Scheduler:
    """Runs requests to completion over the runner's pools.

    Invariant between steps: a running request holds a request row and the KV slots of its
    first ``kv_len`` tokens; waiting and finished requests hold neither.
    """

    def __init__(self, runner: ModelRunner, memory: RequestMemory,
                 output_processor: OutputProcessor, sampler: Sampler,
                 max_prefill_tokens: int = 8192):
        self.runner = runner
        self.memory = memory
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
            self.memory.release(req)
        req.finish_reason = finish_abort(message)
        req.final_text = req.detokenizer.text

    def _admit(self) -> list[Req]:
        memory = self.memory
        rows = memory.req_to_token_pool.available_size()
        reserved = sum(self._tokens_still_needed(r) for r in self.running)
        prefill_tokens = 0
        admitted: list[Req] = []
        while self.waiting and len(admitted) < rows:
            req = self.waiting[0]
            memory.match_and_lock(req)
            need = self._tokens_still_needed(req, len(req.prefix_indices))
            new_tokens = req.seq_len - len(req.prefix_indices)
            too_many = prefill_tokens + new_tokens > self.max_prefill_tokens and admitted
            if need > memory.available_tokens() - reserved or too_many:
                memory.unlock(req)
                break
            self.waiting.popleft()
            memory.assign_row(req)
            admitted.append(req)
            reserved += need
            prefill_tokens += new_tokens
        return admitted

    def _tokens_still_needed(self, req: Req, kv_len: int | None = None) -> int:
        """KV slots ``req`` may still take beyond its first ``kv_len`` tokens, in whole pages.

        A request's own tokens fill its own pages, so over its life it holds
        ``pages(prompt + max_new_tokens)``; of these it has ``pages(kv_len)`` already.
        """
        kv_len = req.kv_len if kv_len is None else kv_len
        return pages_for(req.max_total_len(), self.memory.page_size) - pages_for(
            kv_len, self.memory.page_size
        )

    def _run_extend(self, reqs: list[Req]) -> list[Req]:
        self.running.extend(reqs)
        return self._forward(ForwardMode.EXTEND, reqs, [r.all_ids()[r.kv_len :] for r in reqs])

    def _run_decode(self) -> list[Req]:
        reqs = list(self.running)
        return self._forward(ForwardMode.DECODE, reqs, [[r.output_ids[-1]] for r in reqs])

    def _forward(self, mode: ForwardMode, reqs: list[Req], new_ids: list[list[int]]) -> list[Req]:
        """Allocates KV for each request's new tokens, runs the model, processes the output.

        A request's ``kv_len`` advances as soon as its slots are allocated, so that if a
        later allocation or the forward pass fails, aborting the requests frees everything.
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
            mode, input_ids, positions, torch.cat(slots), [r.req_pool_idx for r in reqs],
            prefix_lens, extend_lens,
        )
        hidden = self.runner.forward(batch)
        return self._process(reqs, hidden, prefix_lens, extend_lens)

    def _process(
        self, reqs: list[Req], hidden: torch.Tensor, prefix_lens: list[int], extend_lens: list[int]
    ) -> list[Req]:
        self.output_processor.process(reqs, hidden, prefix_lens, extend_lens, self.sampler)
        for req, extend in zip(reqs, extend_lens):
            if req.finished:
                self.running.remove(req)
                self.memory.release(req)
            elif extend > 1:
                # A new prompt becomes shareable at once, not only when its request ends.
                self.memory.cache_unfinished(req)
        return reqs


def pages_for(num_tokens: int, page_size: int) -> int:
    """Slots of the whole pages that ``num_tokens`` tokens occupy."""
    return -(-num_tokens // page_size) * page_size
