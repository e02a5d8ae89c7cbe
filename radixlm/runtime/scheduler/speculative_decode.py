"""Speculative decode steps: draft tokens verified in one forward pass over the paged KV.

A decode step where some running request has a draft (``runtime/speculative``) checks it in
the same one forward pass: each request runs its last token and its k draft tokens (k = 0
for a request without one, which the pass decodes as usual), as k + 1 rows of a decode batch
(``StepBatches.verify``: row j at position ``kv_len + j``, seeing the rows before it), so
the pass computes k + 1 next-token distributions for it. Then, position by position, the
request's next token is chosen exactly as a decode step would choose it there (the sampler
with every setting the request has: penalties, grammar mask, seed, thinking budget) and
appended (stop checks).
While it equals the draft token at that position, the next position's distribution is the
target's too and the request goes on. It stops at the first token that differs from the
draft (that token is kept: the target chose it), at its end (a stop, its budget), where
jump-forward appended tokens after it (the tokens it forced then wait for the next step, as
after any jump), or after the token following its last draft token. One pass thus gives a
request 1 .. k + 1 tokens.

Token trees (``draft_tree.Draft``, n-gram drafts with ``speculative_ngram_max_bfs_breadth``
above 1): every node is a row, at its depth's position, seeing the request's tokens and its
own ancestors only (``StepBatches.verify``); the request follows the tree, going on from the
child that holds the token it chose, and stops where no child does. It keeps its path's KV:
where the path leaves the main chain, the path's KV is first copied to the slots of the
positions the request keeps (``_keep_paths``).

Exactness. Every token is the one the request's sampler chooses given the tokens before it,
as a decode step chooses it; the draft only decides how many positions one pass checks.
Greedy outputs are those of decoding without speculation. For sampled requests this is the
standard rejection rule for a draft that is a single token (q one-hot at x: accept with
probability min(1, p(x) / q(x)) = p(x), else draw from max(p - q, 0) normalised, which is p
without x): the token drawn from p equals x with probability p(x) and is any other y with
probability p(y), exactly the rule's outcome. N-gram drafts are such tokens, and in a
token tree the token drawn from p picks at most one child, with the same outcome. A
seeded request draws each position's uniform from (its seed, its output position), so its
tokens are the same with speculation as without. (Numerically, the verify pass is a decode
pass of more rows than a plain step's: where a product's kernel depends on its number of
rows, the logits may differ in the last bits, as those of a batch do from a lone request's.)

KV. The pass writes the KV of all k + 1 tokens; each request keeps the slots of the tokens it
kept (its last token and the accepted drafts) and gives the rest back at once
(``RequestMemory.give_back``), before anything reads its ``kv_len`` again. A failed pass
gives back every draft slot, leaving the requests as a failed decode step leaves them.

Host reads. A batch of greedy requests without other settings reads its argmaxes once, as a
decode step reads its tokens; any other batch reads each checked position's token (on an
accelerator, a wait per position): both declared in ``host_reads.py``.
"""

from __future__ import annotations

import time

import torch

from radixlm.host_to_device import to_device
from radixlm.kv_cache.allocator import pages_for
from radixlm.kv_cache.memory_pool import copy_slots
from radixlm.runtime.model_executor.model_runner import ModelRunner
from radixlm.runtime.request import Req
from radixlm.runtime.sampling.logprobs import LogprobCopy
from radixlm.runtime.sampling.sampler import Sampler
from radixlm.runtime.scheduler.request_memory import RequestMemory
from radixlm.runtime.scheduler.sampling_step import SamplingStep
from radixlm.runtime.scheduler.scheduler_state import SchedulerState
from radixlm.runtime.scheduler.step_batches import StepBatches
from radixlm.runtime.server_args import ServerArgs
from radixlm.runtime.speculative.draft_model_proposer import DraftModelProposer
from radixlm.runtime.speculative.draft_proposer import DraftProposer
from radixlm.runtime.speculative.draft_tree import Draft
from radixlm.runtime.speculative.ngram_proposer import NgramProposer
from radixlm.runtime.speculative.verify_plan import StepCosts, plan_drafts


class SpeculativeDecode:
    """The decode steps of a scheduler serving with ``--speculative-algorithm``."""

    def __init__(self, state: SchedulerState, memory: RequestMemory, runner: ModelRunner,
                 batches: StepBatches, sampling_step: SamplingStep, sampler: Sampler,
                 proposer: DraftProposer, max_batch_size: int, timed: bool = True):
        """``max_batch_size``: above this many running requests, no step speculates.
        ``timed``: drafts are cut to what pays by the steps' measured costs
        (``verify_plan``); False (``disable_adaptive_timing``): every draft is checked."""
        self.costs = StepCosts() if timed else None
        self.state = state
        self.memory = memory
        self.runner = runner
        self.batches = batches
        self.sampling_step = sampling_step
        self.sampler = sampler
        self.proposer = proposer
        self.max_batch_size = max_batch_size

    def close(self) -> None:
        self.proposer.close()

    def wants_host(self, reqs: list[Req]) -> bool:
        """Whether the next decode step of ``reqs`` might speculate: it must then wait for
        their last tokens on the host (overlap scheduling does not run it ahead)."""
        return (len(reqs) <= self.max_batch_size and not self.state.beam_groups
                and any(self.proposer.may_propose(req) for req in reqs))

    def step(self, reqs: list[Req]) -> list[Req] | None:
        """A verify step over ``reqs`` (every running request, each with one token
        without KV), or None where no request gets a draft: the caller decodes plainly."""
        if len(reqs) > self.max_batch_size or self.state.beam_groups:
            return None
        drafts = self.proposer.propose(reqs, self._budgets(reqs))
        if not any(drafts):
            return None
        self._fit_in_memory(reqs, drafts)
        for req, draft in zip(reqs, drafts):
            if draft and req.grammar is not None:
                draft.keep(_grammar_allows(req, draft))
        if self.costs is not None:
            plan_drafts(drafts, [self.proposer.acceptance_rate(r) for r in reqs], self.costs)
        if not any(drafts):
            return None
        return self._verify(reqs, drafts)

    def observe_plain_step(self, rows: int, seconds: float) -> None:
        """A plain decode step of ``rows`` requests took ``seconds`` (host time)."""
        if self.costs is not None and not self.runner.last_pass_was_trial:
            self.costs.observe(rows, seconds)

    # Drafts --------------------------------------------------------------------------------

    def _budgets(self, reqs: list[Req]) -> list[int]:
        """Draft tokens each request can use: a step appends at most k + 1 tokens, within
        its output limit and the context."""
        context = self.runner.context_length
        return [max(0, min(r.output_limit - len(r.output_ids), context - r.seq_len) - 1)
                for r in reqs]

    def _fit_in_memory(self, reqs: list[Req], drafts: list[Draft]) -> None:
        """Shortens the longest drafts until the pass's KV fits what the pool can give
        (the caller made room for one token each), and the trees' other branches until
        their rows fit the free request rows (``StepBatches.verify``)."""
        page = self.memory.page_size

        def need() -> int:
            return sum(pages_for(r.kv_len + 1 + len(d), page) - pages_for(r.kv_len, page)
                       for r, d in zip(reqs, drafts))

        available = self.memory.available_tokens()
        while need() > available:
            longest = max(drafts, key=len)
            if not longest:
                return
            longest.truncate(len(longest) - 1)
        free_rows = self.memory.req_to_token_pool.available_size()
        for draft in drafts:
            branches = draft.branch_starts()
            if len(branches) > free_rows:
                draft.truncate(branches[free_rows])
            free_rows -= min(free_rows, len(branches))

    # The pass ------------------------------------------------------------------------------

    def _verify(self, reqs: list[Req], drafts: list[Draft]) -> list[Req]:
        state = self.state
        listed: list[list[int]] = []
        branch_rows: list[int] = []
        started = time.perf_counter()
        try:
            batch = self.batches.verify(reqs, drafts, listed, branch_rows)
            hidden = self.runner.forward(batch)
            state.stats.forward_steps += 1
            state.note_kv_peak(self.memory)
            logits = self.runner.compute_logits(hidden)  # (T, V): every position checked
            paths = self._accept(reqs, drafts, logits)
            if self.costs is not None and not self.runner.last_pass_was_trial:
                self.costs.observe(len(batch.input_ids), time.perf_counter() - started)
        except BaseException:
            for req, slots in zip(reqs, listed):  # as a failed decode step leaves them
                self.memory.give_back(req, slots, 1)
            raise
        finally:
            for row in branch_rows:
                self.memory.req_to_token_pool.free(row)
        self._keep_paths(listed, paths)
        stats = state.stats
        stats.spec_verify_steps += 1
        rows, offset = [], 0
        for req, draft, slots, path in zip(reqs, drafts, listed, paths):
            self.memory.give_back(req, slots, len(path) + 1)
            main = draft.main_length
            self.proposer.observe(req, main, min(len(path), main))
            req.spec_verify_ct += bool(draft)
            stats.spec_drafted_requests += bool(draft)
            stats.spec_draft_tokens += len(draft)
            stats.spec_accepted_tokens += len(path)
            stats.spec_accepted_branch_tokens += sum(
                node != depth for depth, node in enumerate(path))
            rows.append([offset, *(offset + 1 + node for node in path)])
            offset += len(draft) + 1
        self.proposer.after_verify(reqs, hidden, rows)
        finished = [req for req in reqs if req.finished]
        for req in finished:
            state.running.remove(req)
            self.memory.release(req)
        state.sampling_batch.remove(finished)
        return reqs

    def _accept(self, reqs: list[Req], drafts: list[Draft],
                logits: torch.Tensor) -> list[list[int]]:
        """Appends each request's tokens, position by position down its draft (see the
        module), and returns each request's path: the draft nodes whose KV it keeps."""
        batch = self.state.sampling_batch
        plain = batch.is_plain_greedy()
        if plain:
            chosen = self.sampler.argmax(logits).tolist()  # the step's one wait
        paths, wanted, offset = [], [], 0
        for req, draft in zip(reqs, drafts):
            node, path = -1, []  # node -1: the request's last token
            while True:
                row = offset + 1 + node
                if plain:
                    token = chosen[row]
                else:  # the row's settings, as a decode step applies them at this position
                    # (a view copies the row's state: taken afresh after each token)
                    row_view = batch.select([req])
                    drawn = self.sampler.sample(logits[row : row + 1], row_view)
                    row_view.record_sampled(drawn)
                    token = int(drawn.item())  # this position's wait
                outputs = len(req.output_ids)
                self.sampling_step.append_tokens([req], [token], batch)
                if req.logprobs is not None:
                    wanted.append((req, row, token))
                node = draft.child(node, token)
                jumped = len(req.output_ids) > outputs + 1  # jump-forward appended tokens
                if node is not None and (jumped or not req.finished):
                    # After a jump the draft's token, if it was this one, has its KV too.
                    path.append(node)
                if req.finished or node is None or jumped:
                    break
            paths.append(path)
            offset += len(draft) + 1
        if wanted:
            self._add_logprobs(wanted, logits)
        return paths

    def _keep_paths(self, listed: list[list[int]], paths: list[list[int]]) -> None:
        """Moves each request's kept KV to the first slots of its pass: the node at depth
        d of its path to slot ``d`` of its ``listed`` (its position ``kv_len + d`` in its
        row). A main-chain path is there already; a path down another branch of a tree
        copies its nodes' KV there (every layer), and ``listed`` is reordered to match."""
        sources, targets = [], []
        for slots, path in zip(listed, paths):
            for depth, node in enumerate(path, 1):
                if node + 1 != depth:
                    sources.append(slots[node + 1])
                    targets.append(slots[depth])
        if not sources:
            return
        device = self.memory.req_to_token.device
        copy_slots(self.runner.kv_pool, to_device(sources, torch.int64, device),
                   to_device(targets, torch.int64, device))

    def _add_logprobs(self, wanted: list[tuple[Req, int, int]], logits: torch.Tensor) -> None:
        """Each kept token's logprob entry (and top alternatives) from its position's
        logits, in the order of the request's tokens."""
        device = logits.device
        rows = to_device([row for _, row, _ in wanted], torch.int64, device)
        tokens = to_device([token for _, _, token in wanted], torch.int64, device)
        top_k = max(req.logprobs.top_k for req, _, _ in wanted)
        found = LogprobCopy.start(logits.index_select(0, rows), tokens, top_k).read()
        self.sampling_step.add_output_logprobs(
            [(req, i) for i, (req, _, _) in enumerate(wanted)], found)


def _grammar_allows(req: Req, draft: Draft) -> list[bool]:
    """Which nodes of ``draft`` the request's grammar accepts after its output, with their
    ancestors (its matcher is left as it was)."""
    matcher = req.grammar
    allowed = []
    for node in range(len(draft)):
        path, accepted = draft.path(node), 0
        for step in path:
            if matcher.is_terminated() or not matcher.accept_token(draft.tokens[step]):
                break
            accepted += 1
        if accepted:
            matcher.rollback(accepted)
        allowed.append(accepted == len(path))
    return allowed


def build_speculation(args: ServerArgs, state: SchedulerState, memory: RequestMemory,
                      runner: ModelRunner, batches: StepBatches, sampling_step: SamplingStep,
                      sampler: Sampler) -> SpeculativeDecode | None:
    """The speculative decode steps ``args`` ask for, or None."""
    if args.speculative_algorithm is None:
        return None
    if memory.window is not None:  # (kv_pool_layout keeps the plain pool for speculation)
        raise ValueError("speculative decoding needs the plain KV pool, not the hybrid one")
    max_draft = args.speculative_num_draft_tokens - 1  # (the verify checks the last token too)
    if args.speculative_algorithm == "STANDALONE":
        proposer = DraftModelProposer.build(args, runner, max_draft)
    else:
        tree = None if args.speculative_ngram_disable_radix_tree else memory.tree_cache
        proposer = NgramProposer(tree, max_draft, args.speculative_ngram_min_match_window_size,
                                 args.speculative_ngram_max_match_window_size,
                                 args.speculative_ngram_max_bfs_breadth)
    return SpeculativeDecode(state, memory, runner, batches, sampling_step, sampler,
                             proposer, args.speculative_disable_by_batch_size,
                             timed=not args.disable_adaptive_timing)
