"""A beam search whose step fails, at any point of it, ends alone: every member with an
error, its rows and KV returned (the pool idle), the requests beside it and those after it
served. And the parameters that once made a step fail are refused or handled where they
enter: length penalties at their extremes, stop tokens that cover the vocabulary before
``min_new_tokens`` (issue 54, item 2)."""

from __future__ import annotations

import pytest
from beam_reference import beam
from runtime_checks import assert_pool_idle, beam_reqs, run_to_completion, scheduler_req
from workloads import random_ids

from radixlm.runtime.sampling import beam_search as beam_search_module
from radixlm.runtime.sampling.sampling_params import LENGTH_PENALTY_LIMIT, SamplingParams
from radixlm.runtime.scheduler import beam_groups as beam_groups_module
from radixlm.runtime.scheduler.beam_groups import BeamGroup

LONG = dict(ignore_eos=True)


class Injected(RuntimeError):
    """The fault a test puts into a step."""


class FailingOnCall:
    """``real``, except that its ``call``-th call (1-based) raises ``Injected``."""

    def __init__(self, real, call: int):
        self.real, self.call, self.calls = real, call, 0

    @property
    def fired(self) -> bool:
        return self.calls >= self.call

    def function(self):
        """A plain function doing it (a method too, where set on a class)."""
        def call(*args, **kwargs):
            self.calls += 1
            if self.calls == self.call:
                raise Injected(f"injected into call {self.call}")
            return self.real(*args, **kwargs)
        return call


POINTS = {  # where a step fails: (owner, attribute)
    "step": (BeamGroup, "step"),  # before anything
    "search": (beam_search_module.BeamSearch, "step"),  # after the pages are noted
    "fork": (BeamGroup, "_fork"),
    "copy_on_write": (beam_groups_module, "copy_slots"),  # after its pages are allocated
    "free_pages": (BeamGroup, "_free_pages"),  # after the rows are forked
    "finish": (BeamGroup, "finish"),
}


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("call", [1, 3])  # the first step (rows not yet shared), a later one
@pytest.mark.parametrize("point", list(POINTS))
def test_a_step_that_fails_anywhere_ends_its_search_alone_and_frees_it(
        scheduler_for, monkeypatch, point, call, page_size):
    scheduler = scheduler_for(page_size=page_size)
    owner, name = POINTS[point]
    fault = FailingOnCall(getattr(owner, name), 1 if point == "finish" else call)
    monkeypatch.setattr(owner, name, fault.function())
    members = beam_reqs(scheduler, random_ids(1300, 13), beam(3, 12, **LONG))
    bystander = scheduler_req(scheduler, random_ids(1301, 9),
                              {"max_new_tokens": 12, "temperature": 0, **LONG})
    for req in [*members, bystander]:
        scheduler.add_request(req)
    reported = []
    for _ in range(100):
        if all(r.finished for r in [*members, bystander]):
            break
        reported += scheduler.step()
    monkeypatch.undo()
    assert fault.fired or point == "copy_on_write"  # (a step may copy no page)
    for member in members:
        if fault.fired:
            assert member.finish_reason["type"] == "abort", member.finish_reason
            assert "beam search failed: Injected" in member.finish_reason["message"]
        else:
            assert member.finish_reason["type"] == "length"
        assert member in reported
    assert bystander.finish_reason["type"] == "length" and len(bystander.output_ids) == 12
    assert not scheduler.state.running and not scheduler.state.beam_groups
    assert_pool_idle(scheduler.server_info())
    again = beam_reqs(scheduler, random_ids(1300, 13), beam(3, 6, **LONG))
    run_to_completion(scheduler, again)
    assert all(r.finish_reason["type"] == "length" for r in again)
    assert_pool_idle(scheduler.server_info())


@pytest.mark.parametrize("length_penalty", [-LENGTH_PENALTY_LIMIT, -3.0, 0.0,
                                            LENGTH_PENALTY_LIMIT])
@pytest.mark.parametrize("early_stopping", [False, "never"])
def test_length_penalties_at_their_extremes_end_with_width_hypotheses(
        scheduler_for, length_penalty, early_stopping):
    """-10 scales a long hypothesis's score far below transformers' DEAD sentinel (-1e9), +10
    overflows a length ** penalty of the budget's length: neither may lose a hypothesis."""
    scheduler = scheduler_for()
    members = beam_reqs(scheduler, random_ids(1302, 11),
                        beam(4, 40, length_penalty, early_stopping, **LONG))
    run_to_completion(scheduler, members)
    assert [r.finish_reason["type"] for r in members] == ["length"] * 4
    assert all(r.output_ids for r in members)
    assert_pool_idle(scheduler.server_info())


@pytest.mark.parametrize("value", [-LENGTH_PENALTY_LIMIT - 0.5, LENGTH_PENALTY_LIMIT + 1, -100,
                                   1000, float("inf"), float("nan")])
def test_length_penalties_beyond_the_limit_are_refused(value):
    with pytest.raises(ValueError, match="length_penalty"):
        SamplingParams.from_dict(beam(2, 8, value))


@pytest.mark.parametrize("stop, ignore_eos", [
    (list(range(384)), False),  # the whole vocabulary
    (list(range(1, 384)), False),  # all but the EOS token, which stops too
])
def test_stop_tokens_covering_the_vocabulary_before_min_new_tokens_are_refused(stop,
                                                                                ignore_eos):
    params = SamplingParams.from_dict({"min_new_tokens": 2, "stop_token_ids": stop,
                                       "ignore_eos": ignore_eos})
    with pytest.raises(ValueError, match="cover the whole vocabulary"):
        params.check_vocab(384, frozenset({0}))
    SamplingParams.from_dict({"stop_token_ids": stop}).check_vocab(384, frozenset({0}))
    SamplingParams.from_dict({"min_new_tokens": 2, "stop_token_ids": stop[1:],
                              "ignore_eos": True}).check_vocab(384, frozenset({0}))
