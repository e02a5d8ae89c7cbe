"""The forward batches of the scheduler's steps, built with their requests' KV slots.

A request's ``kv_len`` advances as soon as its slots are allocated, so that if a later
allocation or the forward pass fails, aborting the requests frees everything.
"""

from __future__ import annotations

import torch

from radixlm.kernels.forward_batch import ForwardBatch, ForwardMode
from radixlm.runtime.model_executor.model_runner import ModelRunner
from radixlm.runtime.request import Req
from radixlm.runtime.scheduler.beam_groups import shared_prefixes
from radixlm.runtime.scheduler.request_memory import RequestMemory
from radixlm.runtime.scheduler.scheduler_state import SchedulerState
from radixlm.runtime.speculative.draft_tree import Draft


class StepBatches:
    """Builds decode and extend batches over the runner's pools."""

    def __init__(self, state: SchedulerState, memory: RequestMemory, runner: ModelRunner):
        self.state = state
        self.memory = memory
        self.runner = runner

    def decode(self, reqs: list[Req], known_inputs: bool) -> ForwardBatch:
        """Allocates a slot for each request's next token and builds the decode batch;
        ``known_inputs`` False: the input tokens are left for the worker to fill in."""
        kv_lens = [r.kv_len for r in reqs]
        input_ids = [r.output_ids[-1] for r in reqs] if known_inputs else [0] * len(reqs)
        inputs = self.runner.decode_inputs(input_ids, kv_lens, [r.req_pool_idx for r in reqs])
        _, positions, rows = inputs.unbind(0)
        slots = self.memory.alloc_decode(reqs, rows, positions)
        for req in reqs:
            req.kv_len += 1
        shared = shared_prefixes(reqs) if self.state.beam_groups else None
        batch = self.runner.make_decode_batch(inputs, slots, kv_lens, shared)
        return self._with_adapters(batch, reqs, [1] * len(reqs))

    def extend(self, reqs: list[Req], new_ids: list[list[int]]) -> ForwardBatch:
        """Allocates KV for each request's new tokens and builds the extend batch."""
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
            [r.req_pool_idx for r in reqs], prefix_lens, extend_lens)
        return self._with_adapters(batch, reqs, extend_lens)

    def _with_adapters(self, batch: ForwardBatch, reqs: list[Req],
                       rows: list[int]) -> ForwardBatch:
        """``batch`` with its rows' LoRA adapters (``reqs`` own ``rows`` rows each, in
        order), where the server has adapters and a request uses one."""
        lora = self.runner.lora
        if lora is not None:
            batch.lora = lora.batch_for([r.lora_name for r in reqs], rows)
        return batch

    def verify(self, reqs: list[Req], drafts: list[Draft], listed: list[list[int]],
               branch_rows: list[int]) -> ForwardBatch:
        """A speculative verify step's batch, in decode form: one row per checked token (a
        request's last token, then its draft's nodes), a node at depth d at position
        ``kv_len + d``, attending to the request's tokens and its own ancestors. Every
        backend's decode step stores a layer's new K/V for all rows before any row
        attends, so the rows of one request see each other's KV as an extend's tokens do;
        and the step runs the decode path (on CPUs the fused decode layers, on GPUs its
        graphs where they fit), which costs little more for a few rows than for one.

        A row attends to the slots its request row lists up to its position: the main
        chain's nodes are in the request's own row, as its next tokens; each other branch
        of a token tree gets a row of the request-row pool (``branch_rows`` collects them,
        for the caller to give back), holding its parent's row up to the parent and then
        its own nodes, so that every row's keys are its ancestors'. ``listed`` gets each
        request's slots (its last token's, then its nodes' in order) as host integers
        (``RequestMemory.give_back`` returns the rejected ones). A request's rows all run
        under its LoRA adapter."""
        rows_pool = self.memory.req_to_token_pool
        table = rows_pool.req_to_token
        input_ids, positions, rows, slots = [], [], [], []
        for req, draft in zip(reqs, drafts):
            listed.append([])
            slots.append(self.memory.alloc(req, len(draft) + 1, listed[-1]))
            mine = listed[-1]
            node_rows = [req.req_pool_idx] * len(draft)
            depths = draft.depths()
            for node in range(draft.main_length, len(draft)):
                parent = draft.parents[node]
                if parent == node - 1:  # its branch goes on in its parent's row
                    node_rows[node] = node_rows[parent]
                    table[node_rows[node], req.kv_len + depths[node]] = mine[node + 1]
                    continue
                row = node_rows[node] = rows_pool.alloc()  # (the caller made sure of it)
                branch_rows.append(row)
                upto = req.kv_len + depths[node]  # the parent's position + 1
                parent_row = req.req_pool_idx if parent < 0 else node_rows[parent]
                table[row, :upto] = table[parent_row, :upto]
                table[row, upto] = mine[node + 1]
                rows_pool.mark_rewritten(row, upto + 1)
            input_ids += [req.output_ids[-1], *draft.tokens]
            positions += [req.kv_len, *(req.kv_len + d for d in depths)]
            rows += [req.req_pool_idx, *node_rows]
            req.kv_len += len(draft) + 1
        inputs = self.runner.decode_inputs(input_ids, positions, rows)
        batch = self.runner.make_decode_batch(inputs, torch.cat(slots), positions)
        return self._with_adapters(batch, reqs, [len(draft) + 1 for draft in drafts])
