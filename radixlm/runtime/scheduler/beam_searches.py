"""The scheduler's part of beam search: groups joining, stepping and leaving (the group's
own part, its rows and KV, is ``beam_groups.py``)."""

from __future__ import annotations

import logging

import torch

from radixlm.host_to_device import to_device
from radixlm.runtime.model_executor.model_runner import ModelRunner
from radixlm.runtime.request import Req, finish_abort
from radixlm.runtime.scheduler.beam_groups import BeamGroup
from radixlm.runtime.scheduler.request_memory import RequestMemory
from radixlm.runtime.scheduler.sampling_step import SamplingStep
from radixlm.runtime.scheduler.scheduler_state import SchedulerState

logger = logging.getLogger(__name__)


class BeamSearches:
    """The beam searches of the scheduler's requests, from their leader's arrival to their
    end."""

    def __init__(self, state: SchedulerState, memory: RequestMemory, runner: ModelRunner,
                 sampling_step: SamplingStep):
        self.state = state
        self.memory = memory
        self.runner = runner
        self.sampling_step = sampling_step

    def join(self, req: Req) -> bool:
        """Makes ``req`` a beam search's leader (True: it queues) or adds it to its
        leader's group (False: it runs when the group does; one whose search already
        ended is reported ended at the next step)."""
        leader = req.prefill_leader
        if leader is None:
            BeamGroup(req, self.memory.page_size)
            return True
        if leader.finished or leader.beam is None or leader.beam.complete:
            req.finish_reason = finish_abort("its beam search ended, or has all its members")
            self.state.to_report.append(req)
        else:
            leader.beam.add(req)
        return False

    def rows(self, reqs: list[Req], extend_lens: list[int] | None
                   ) -> list[tuple[BeamGroup, list[int]]]:
        """The beam searches with beams to step in this batch, and each one's rows of the
        hidden states (its running beams' last tokens, in the group's order).
        ``extend_lens`` None: a decode batch, a row per request."""
        if not self.state.beam_groups and (extend_lens is None  # (no leader decodes)
                                     or not any(r.beam is not None for r in reqs)):
            return []
        rows: dict[int, int] = {}
        groups: dict[int, BeamGroup] = {}
        end = 0
        for i, req in enumerate(reqs):
            end += 1 if extend_lens is None else extend_lens[i]
            if req.beam is not None and req.kv_len == req.seq_len:  # its prompt is done
                rows[id(req)] = end - 1
                groups[id(req.beam)] = req.beam
        return [(group, [rows[id(m)] for m in group.running()]) for group in groups.values()]

    def step(self, hidden: torch.Tensor,
                    beam_rows: list[tuple[BeamGroup, list[int]]]) -> list[Req]:
        """Steps each beam search from its rows of ``hidden``; returns the members of
        searches that ended, beyond the batch's requests (those that never ran)."""
        ended: list[Req] = []
        for group, rows in beam_rows:
            was_running = group.expanded
            try:
                self._step_one(group, rows, hidden)
            except Exception as err:  # one search's failure ends it alone, freeing it all
                logger.exception("a beam search step failed")
                self.abort(group, f"beam search failed: {type(err).__name__}: "
                                               f"{err}")
                if not was_running:
                    ended += group.members[1:]
                continue
            if group.search.done and not was_running:
                ended += group.members[1:]
        if beam_rows:
            self.state.note_kv_peak(self.memory)
        return ended

    def _step_one(self, group: BeamGroup, rows: list[int],
                          hidden: torch.Tensor) -> None:
        """One step of ``group`` from its rows of ``hidden``: it ends (finished, out of
        ``running``) or runs on (its members in ``running``, next to each other)."""
        index = to_device(rows, torch.int64, hidden.device)
        logits = self.sampling_step.compute_logits(hidden.index_select(0, index))
        was_running = group.expanded
        if group.step(logits, self.memory, self.runner.kv_pool):
            self.remove(group)
            group.finish(self.memory)
        elif not was_running:  # the members run next to each other
            running = self.state.running
            after = running.index(group.leader) + 1
            running[after:after] = group.members[1:]
            self.state.beam_groups.append(group)

    def remove(self, group: BeamGroup) -> None:
        """Takes the group's members out of ``running`` (and the group out of
        ``beam_groups``)."""
        state, members = self.state, {id(m) for m in group.members}
        state.running = [r for r in state.running if id(r) not in members]
        if group in state.beam_groups:
            state.beam_groups.remove(group)

    def abort(self, group: BeamGroup, message: str) -> None:
        """Ends every member of ``group`` with ``message``, freeing what it holds."""
        state, leader = self.state, group.leader
        if leader in state.waiting:
            state.waiting.remove(leader)
        else:
            if leader is state.chunked:
                state.chunked = None
            self.remove(group)
            group.release(self.memory)
        for member in group.members:
            if not member.finished:
                member.finish_reason = finish_abort(message)
