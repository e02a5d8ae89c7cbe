"""Beam searches in the scheduler: a group of requests whose rows share KV slots.

A beam search of width k arrives as k requests (``rid-0`` .. ``rid-{k-1}``, as ``n``
samples do). The first, the leader, carries the prompt; it waits in the queue until the
others have arrived, then is admitted with k request rows and k times a request's KV
reservation. Its prompt is prefilled once (after a prefix-cache match; in chunks if
long). From the logits of its last prompt token the search (``sampling/beam_search.py``)
picks the first k beams, and from then on each beam runs as one of the k requests, in
ordinary decode steps beside other requests. Members report nothing until the end.

KV is shared, not copied. After each step, beam j continues beam ``parents[j]``: its row of
``req_to_token`` takes the parent's slots, so hypotheses share the KV of everything up to
where they diverge, and the pages that no row and no kept hypothesis refers to any more are
freed. With pages of several tokens, a parent's partly filled last page goes on with its
first child and every other child gets a copy (copy on write): a page is written by one
beam only.

Ownership: the prompt's slots are the leader's, as for any request (tree-owned up to its
cached prefix); the group owns every page from ``base`` (the prompt's last page boundary)
on, in any member's row or kept hypothesis. So after t steps the group holds at most the
prompt plus k x t slots, plus a page per beam with paging.

When the search ends, the members take the k best hypotheses, best first; the leader takes
the best with its KV and hands it to the prefix cache as any finished request does. A
retracted or aborted group frees what it owns (the prompt goes to the cache) and starts
over or ends.
"""

from __future__ import annotations

import operator

import torch

from radixlm.host_to_device import to_device
from radixlm.kv_cache.memory_pool import copy_slots
from radixlm.runtime.request import Req, finish_length, finish_stop
from radixlm.runtime.sampling.beam_search import BeamSearch
from radixlm.runtime.scheduler.request_memory import RequestMemory


class BeamGroup:
    """The members of one beam search (the leader first) and the search's state.

    Invariants: before ``expanded``, only the leader runs (waiting, prefilling, or being
    admitted with the followers' rows); after it, all ``width`` members run, each with
    ``kv_len == prompt_len + search.length`` between steps (their last token without KV).
    """

    def __init__(self, leader: Req, page_size: int):
        """``leader``: a request that ``SamplingStep.prepare`` has seen (its stop tokens
        and output limit are the search's EOS tokens and budget)."""
        params = leader.sampling
        self.leader = leader
        self.members = [leader]
        self.width = params.n
        self.page_size = page_size
        self.prompt_len = len(leader.input_ids)
        self.base = self.prompt_len - self.prompt_len % page_size
        self.search = BeamSearch(self.width, leader.output_limit, leader.stop_token_ids,
                                 params.length_penalty, params.early_stopping,
                                 params.min_new_tokens)
        self.expanded = False
        self._step_pages: list[torch.Tensor] | None = None  # see ``step``
        leader.beam = self

    @property
    def complete(self) -> bool:
        """Whether every member has arrived (the leader is admitted only then)."""
        return len(self.members) == self.width

    def add(self, follower: Req) -> None:
        follower.beam = self
        self.members.append(follower)

    def running(self) -> list[Req]:
        """The requests that hold a beam now: one row of logits each, in this order."""
        return self.members if self.expanded else [self.leader]

    def take_rows(self, memory: RequestMemory) -> None:
        """At admission (the leader has its row): a row for each other member."""
        for follower in self.members[1:]:
            follower.req_pool_idx = memory.req_to_token_pool.alloc()
            assert follower.req_pool_idx is not None, "admission counts a row per beam"

    def step(self, logits: torch.Tensor, memory: RequestMemory, kv_pool) -> bool:
        """One step of the search from ``logits`` (len(running()), V), the running beams'
        next-token logits: forks the rows, frees what no beam holds any more. Returns
        whether the search has ended (then ``finish``)."""
        beams = self.running()
        table = memory.req_to_token
        end = self.prompt_len + self.search.length
        assert all(b.kv_len == end for b in beams), "every beam has KV up to its last token"
        rows = _rows_of(beams, table)
        before = self._held_pages(table, rows, end)
        # Until the step ends, the group owns exactly these pages and those the step
        # allocates (appended here), whatever state the rows are left in: ``release`` frees
        # them if the step fails half-way.
        self._step_pages = [before]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        choice = self.search.step(
            logprobs, lambda parent: table[beams[parent].req_pool_idx, self.base:end].clone())
        if not choice.done:
            rows = self._fork(choice.parents, rows, end, memory, kv_pool)
        self._free_pages(memory, before, self._held_pages(table, rows, end))
        self._step_pages = None
        return choice.done

    def finish(self, memory: RequestMemory) -> None:
        """Ends every member with its hypothesis, best first; the leader's KV (the best
        hypothesis's) goes to the cache, the rest is freed, the rows are returned."""
        table = memory.req_to_token
        beams = self.running()
        end = beams[0].kv_len
        rows = _rows_of(beams, table)
        results = self.search.results()
        if len(results) < len(self.members) or any(h.payload is None for h in results):
            raise RuntimeError(f"beam search kept {len(results)} of {len(self.members)} "
                               "hypotheses")  # (a search that ran to its end keeps them all)
        best = results[0].payload
        held = self._held_pages(table, rows, end)
        self._free_pages(memory, held, torch.unique(best // self.page_size))
        leader = self.leader
        table[leader.req_pool_idx, self.base : self.base + best.numel()] = best
        leader.output_ids = list(results[0].tokens)
        leader.kv_len = self.base + best.numel()
        leader.last_slot = self._slot_before(memory, leader.kv_len)
        memory.release(leader)
        self._return_follower_rows(memory)
        eos = self.search.eos_set
        for member in self.members[1:]:  # they ran on the leader's prompt
            member.cached_tokens, member.retractions = leader.cached_tokens, leader.retractions
        for member, hypothesis in zip(self.members, results):
            member.output_ids = list(hypothesis.tokens)
            member.cumulative_logprob = hypothesis.cumulative_logprob
            member.beam_score = hypothesis.score
            last = hypothesis.tokens[-1]
            member.finish_reason = (finish_stop(last) if last in eos
                                    else finish_length(len(hypothesis.tokens)))

    def release(self, memory: RequestMemory) -> None:
        """Frees everything the group holds (a retraction or an abort): the beams' KV, the
        rows; the prompt's KV goes to the cache. The search starts over if run again."""
        leader = self.leader
        if leader.req_pool_idx is not None:
            if self._step_pages is not None:  # a step failed half-way: what it owned
                held = torch.unique(torch.cat(self._step_pages))
                self._free_pages(memory, held, held[:0])
                leader.kv_len = self.base
                leader.last_slot = self._slot_before(memory, self.base)
            elif self.expanded:
                table = memory.req_to_token
                beams = self.running()
                rows = _rows_of(beams, table)
                held = self._held_pages(table, rows, beams[0].kv_len)
                self._free_pages(memory, held, held[:0])
                leader.kv_len = self.base  # what remains the leader's: the prompt's pages
                leader.last_slot = self._slot_before(memory, self.base)
            leader.output_ids = []
            memory.release(leader)
            self._return_follower_rows(memory)
        for member in self.members:
            member.output_ids = []
        self.search.reset()
        self.expanded = False
        self._step_pages = None

    # Rows and pages -----------------------------------------------------------------------

    def _slot_before(self, memory: RequestMemory, end: int) -> int:
        """The slot of the leader's token at ``end - 1`` (-1 for none), which
        ``RequestMemory.release`` frees the unaligned tail by (a beam search reads the
        host at every step already)."""
        if end == 0:
            return -1
        return int(memory.req_to_token[self.leader.req_pool_idx, end - 1])

    def _fork(self, parents: list[int], rows: torch.Tensor, end: int,
              memory: RequestMemory, kv_pool) -> torch.Tensor:
        """Points each member's row at its parent's slots and gives it its tokens; returns
        the members' rows."""
        table = memory.req_to_token
        members = self.members
        new_rows = _rows_of(members, table)
        if not self.expanded:  # the followers take the prompt's slots
            table[new_rows[1:], : self.base] = table[self.leader.req_pool_idx, : self.base]
            self.expanded = True
        parent_rows = rows[to_device(parents, torch.int64, table.device)]
        table[new_rows, self.base : end] = table[parent_rows, self.base : end]
        page = self.page_size
        if page > 1 and end % page:
            self._copy_on_write(parents, new_rows, end, memory, kv_pool)
        last_slots = table[new_rows, end - 1].tolist() if page > 1 else [-1] * len(members)
        for member, tokens, last_slot in zip(members, self.search.beams, last_slots):
            member.output_ids = list(tokens)
            member.kv_len = end
            member.last_slot = last_slot
            memory.req_to_token_pool.mark_rewritten(member.req_pool_idx, end)
        return new_rows

    def _copy_on_write(self, parents: list[int], new_rows: torch.Tensor, end: int,
                       memory: RequestMemory, kv_pool) -> None:
        """Gives every child but a parent's first a copy of the parent's partly filled last
        page (its first ``end % page`` slots), so each beam writes its own page."""
        page = self.page_size
        seen: set[int] = set()
        copies = []
        for child, parent in enumerate(parents):
            if parent in seen:
                copies.append(child)
            seen.add(parent)
        if not copies:
            return
        start, used = end - end % page, end % page
        table = memory.req_to_token
        copy_rows = new_rows[to_device(copies, torch.int64, table.device)]
        pages = memory.alloc_pages(len(copies) * page)
        if self._step_pages is not None:
            self._step_pages.append(torch.unique(pages // page))
        fresh = pages.view(len(copies), page)[:, :used]
        copy_slots(kv_pool, table[copy_rows, start:end].reshape(-1), fresh.reshape(-1))
        table[copy_rows, start:end] = fresh

    def _held_pages(self, table: torch.Tensor, rows: torch.Tensor, end: int) -> torch.Tensor:
        """The pages the group owns: those of the running rows from ``base`` to ``end``,
        and those of the kept hypotheses."""
        parts = [table[rows, self.base : end].reshape(-1)]
        parts += [h.payload for h in self.search.kept if h.payload is not None]
        return torch.unique(torch.cat(parts) // self.page_size)

    def _free_pages(self, memory: RequestMemory, held: torch.Tensor,
                    still_held: torch.Tensor) -> None:
        """Frees the pages of ``held`` that are not in ``still_held``."""
        gone = held[~torch.isin(held, still_held)]
        memory.allocator.free(gone * self.page_size)

    def _return_follower_rows(self, memory: RequestMemory) -> None:
        for follower in self.members[1:]:
            if follower.req_pool_idx is not None:
                memory.req_to_token_pool.free(follower.req_pool_idx)
            follower.req_pool_idx, follower.kv_len, follower.last_slot = None, 0, -1


def shared_prefixes(reqs: list[Req]) -> list[tuple[int, int, int]]:
    """The runs of ``reqs`` (a decode batch) that are one beam search's members, in order,
    with the prompt slots they share (``ForwardBatch.shared_prefixes``)."""
    runs = []
    for start, req in enumerate(reqs):
        group = req.beam
        if group is None or req is not group.leader:
            continue
        members = reqs[start : start + group.width]
        if len(members) == group.width and all(map(operator.is_, members, group.members)):
            runs.append((start, group.width, group.base))
    return runs


def _rows_of(reqs: list[Req], table: torch.Tensor) -> torch.Tensor:
    """The requests' rows of ``table`` (req_to_token), on its device."""
    return to_device([r.req_pool_idx for r in reqs], torch.int64, table.device)
