"""Draft tokens from a small draft model run beside the target (``--speculative-algorithm
STANDALONE``, ``--speculative-draft-model-path``).

The draft model has a ``ModelRunner`` of its own (weights, KV pool, attention backend) in the
scheduler's process, and reads the target's request rows (``req_to_token``): its KV pool
has every slot the target's has, so a request's slot holds the token's target KV in one pool
and its draft KV in the other, and the target's allocator serves both.

Per request the proposer keeps ``DraftModelState.kv_len``: the positions whose draft KV it
has computed into the request's own slots. A step drafts k tokens per request in k passes
of the draft model, batched over the requests: first an extend over the tokens the draft
has not seen yet (the prompt at the request's first draft, else the tokens kept since its
last) up to and including the last token, whose last row gives the first draft token; then
k - 1 decode passes, each fed the previous draft token. The KV of the last token and of the
draft tokens goes to scratch slots of the draft pool (``max_draft`` per request row, past
the target's slots) and is never kept: the next step's catch-up computes the kept tokens'
draft KV in their real slots. So the draft needs nothing back from the verify step, and
nothing of the target's slots is written before the verify allocates them.

Draft tokens are the draft model's greedy choices, single tokens, which the verify step
accepts by the target's own choice (exact for greedy and sampled requests alike:
``scheduler/speculative_decode.py``).

The draft trusts no KV it did not compute for the request itself: a request starts at
``kv_len`` 0 (a prefix-cache hit saves the target's prompt, not the draft's), and again
after a retraction. A catch-up longer than ``catch_up_tokens`` is spread over steps, in
which the request drafts nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from radixlm.host_to_device import to_device
from radixlm.kernels.forward_batch import ForwardMode
from radixlm.models.model_config import ModelConfig
from radixlm.runtime.model_executor.model_runner import ModelRunner
from radixlm.runtime.request import Req
from radixlm.runtime.server_args import ServerArgs
from radixlm.runtime.speculative.draft_proposer import DraftLength
from radixlm.runtime.speculative.draft_tree import Draft

CATCH_UP_TOKENS = 1024
"""Most tokens of one request's draft KV catch-up in one step (a long prompt's is spread
over steps, as a chunked prefill is)."""


@dataclass
class DraftModelState:
    """What the proposer keeps per request (``Req.drafting``)."""

    length: DraftLength
    kv_len: int = 0
    """Positions 0 .. kv_len - 1 have their draft KV in the request's slots."""
    row: int | None = None
    retractions: int = 0
    """The request row and retraction count ``kv_len`` was computed under."""


class DraftModelProposer:
    """The ``DraftProposer`` of ``--speculative-algorithm STANDALONE`` (see the module)."""

    def __init__(self, runner: ModelRunner, scratch_base: int, max_draft: int,
                 catch_up_tokens: int = CATCH_UP_TOKENS):
        """``runner``: the draft model's, sharing the target's request rows, with
        ``max_draft`` scratch slots per row from ``scratch_base`` on."""
        self.runner = runner
        self.scratch_base = scratch_base
        self.max_draft = max_draft
        self.catch_up_tokens = catch_up_tokens

    @classmethod
    def build(cls, args: ServerArgs, target: ModelRunner, max_draft: int) -> DraftModelProposer:
        """Loads the draft model beside ``target`` (its path checked where the server
        started: ``draft_model_check``)."""
        page = args.page_size
        target_slots = target.allocator.size + page  # (the padding page included)
        scratch = target.req_to_token_pool.size * max_draft
        draft_args = dataclasses.replace(
            args, model_path=args.speculative_draft_model_path, tokenizer_path=None,
            quantization=None, context_length=target.context_length,
            max_total_tokens=target_slots - page + -(-scratch // page) * page,
            speculative_algorithm=None, speculative_draft_model_path=None,
            speculative_num_steps=None, speculative_num_draft_tokens=None,
            disable_cuda_graph=True, enable_torch_compile=False,
            enable_lora=False, lora_paths=None)  # (drafts without adapters: verified with)
        config = ModelConfig.from_path(args.speculative_draft_model_path,
                                       args.trust_remote_code)
        runner = ModelRunner(draft_args, config)
        if runner.window_layout is not None:
            runner.close()
            raise ValueError("a draft model whose sliding layers keep only their window "
                             "is not served (its pool would not mirror the target's slots)")
        runner.req_to_token_pool = target.req_to_token_pool  # the target's rows
        return cls(runner, target_slots, max_draft)

    def propose(self, reqs: list[Req], budgets: list[int]) -> list[Draft]:
        wanted, ends = [], []
        for req, budget in zip(reqs, budgets):
            state = self._state(req)
            want = min(state.length.next(len(req.output_ids)), budget)
            behind = req.kv_len - state.kv_len
            if behind + 1 > self.catch_up_tokens:  # catch up only (no draft this step)
                want, end = 0, state.kv_len + self.catch_up_tokens
            else:
                end = req.kv_len + 1 if want else state.kv_len
            wanted.append(want)
            ends.append(end)
        drafts: list[list[int]] = [[] for _ in reqs]
        first = [i for i, req in enumerate(reqs) if ends[i] > req.drafting.kv_len]
        if not first:
            return [Draft() for _ in reqs]
        tokens = self._catch_up_pass([reqs[i] for i in first], [ends[i] for i in first],
                                     [wanted[i] > 0 for i in first])
        for i, token in zip(first, tokens):
            if wanted[i]:
                drafts[i].append(token)
        for step in range(1, max(wanted)):
            going = [i for i in first if wanted[i] > step]
            if not going:
                break
            tokens = self._decode_pass([reqs[i] for i in going], [drafts[i][-1] for i in going],
                                       step)
            for i, token in zip(going, tokens):
                drafts[i].append(token)
        return [Draft.chain(draft) for draft in drafts]

    def may_propose(self, req: Req) -> bool:
        return req.drafting is None or req.drafting.length.may_draft(len(req.output_ids))

    def observe(self, req: Req, proposed: int, accepted: int) -> None:
        self._state(req).length.observe(proposed, accepted)

    def acceptance_rate(self, req: Req) -> float:
        return self._state(req).length.rate

    def after_verify(self, reqs: list[Req], hidden: torch.Tensor,
                     kept_rows: list[list[int]]) -> None:
        """(a draft model reads no hidden states of the target)"""

    def close(self) -> None:
        self.runner.close()

    # The draft model's passes -----------------------------------------------------------

    def _catch_up_pass(self, reqs: list[Req], ends: list[int], drafting: list[bool]
                       ) -> list[int]:
        """One extend of the draft over each request's tokens from its draft ``kv_len`` to
        ``ends`` (for a drafting request: through its last token, whose KV goes to its
        first scratch slot); returns each request's argmax at its last row."""
        runner = self.runner
        req_to_token = runner.req_to_token_pool.req_to_token
        self._point_at_scratch([r for r, d in zip(reqs, drafting) if d],
                               [r.kv_len for r, d in zip(reqs, drafting) if d], 0)
        input_ids, positions, slot_rows, slot_cols, prefix_lens, extend_lens = (
            [], [], [], [], [], [])
        for req, end in zip(reqs, ends):
            start = req.drafting.kv_len
            input_ids += req.all_ids()[start:end]
            positions += range(start, end)
            slot_rows += [req.req_pool_idx] * (end - start)
            slot_cols += range(start, end)
            prefix_lens.append(start)
            extend_lens.append(end - start)
        index = to_device([slot_rows, slot_cols], torch.int64, req_to_token.device)
        slots = req_to_token[index[0], index[1]]
        batch = runner.make_forward_batch(ForwardMode.EXTEND, input_ids, positions, slots,
                                          [r.req_pool_idx for r in reqs], prefix_lens,
                                          extend_lens)
        hidden = runner.forward(batch)
        last_rows = to_device([sum(extend_lens[: i + 1]) - 1 for i in range(len(reqs))],
                              torch.int64, hidden.device)
        tokens = self._argmax(hidden.index_select(0, last_rows))
        for req, end in zip(reqs, ends):  # real slots only: those before the last token
            req.drafting.kv_len = min(end, req.kv_len)
        return tokens

    def _decode_pass(self, reqs: list[Req], inputs: list[int], step: int) -> list[int]:
        """One decode pass of the draft, feeding each request its draft token ``step``
        (position ``kv_len + step``, KV into its scratch slot ``step``)."""
        runner = self.runner
        kv_lens = [req.kv_len + step for req in reqs]
        slots = self._point_at_scratch(reqs, kv_lens, step)
        batch_inputs = runner.decode_inputs(inputs, kv_lens, [r.req_pool_idx for r in reqs])
        batch = runner.make_decode_batch(batch_inputs, slots, kv_lens)
        return self._argmax(runner.forward(batch))

    def _point_at_scratch(self, reqs: list[Req], positions: list[int], step: int
                          ) -> torch.Tensor:
        """Writes each request's scratch slot ``step`` into its row at ``positions``, past
        its ``kv_len``, where the verify step writes real slots later; returns them."""
        req_to_token = self.runner.req_to_token_pool.req_to_token
        if not reqs:
            return torch.empty(0, dtype=torch.int64, device=req_to_token.device)
        rows = [req.req_pool_idx for req in reqs]
        scratch = [self.scratch_base + row * self.max_draft + step for row in rows]
        values = to_device([rows, positions, scratch], torch.int64, req_to_token.device)
        req_to_token[values[0], values[1]] = values[2]
        return values[2]

    def _argmax(self, hidden: torch.Tensor) -> list[int]:
        logits = self.runner.compute_logits(hidden)[:, : self.runner.model_config.vocab_size]
        return logits.argmax(dim=-1).tolist()  # each draft pass's wait

    def _state(self, req: Req) -> DraftModelState:
        state = req.drafting
        if state is None:
            state = req.drafting = DraftModelState(DraftLength(self.max_draft))
        if state.row != req.req_pool_idx or state.retractions != req.retractions or (
                state.kv_len > req.kv_len):
            state.kv_len, state.row, state.retractions = 0, req.req_pool_idx, req.retractions
        return state
