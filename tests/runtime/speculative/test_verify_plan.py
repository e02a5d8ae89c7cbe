"""The verify plan keeps the draft tokens that pay for their rows, by measured step costs
and each request's acceptance rate; the costs are learned, interpolated, and optimistic
where nothing larger was measured."""

from __future__ import annotations

import random

import pytest
from runtime_checks import run_to_completion, scheduler_req
from workloads import greedy

from radixlm.runtime.speculative.draft_proposer import DraftLength
from radixlm.runtime.speculative.draft_tree import Draft
from radixlm.runtime.speculative.verify_plan import COST_DECAY, StepCosts, plan_drafts


def costs_of(table: dict[int, float]) -> StepCosts:
    costs = StepCosts()
    for rows, seconds in table.items():
        costs.observe(rows, seconds)
    return costs


def chains(lists: list[list[int]]) -> list[Draft]:
    return [Draft.chain(tokens) for tokens in lists]


def tokens(drafts: list[Draft]) -> list[list[int]]:
    return [draft.tokens for draft in drafts]


def test_costs_are_running_averages_interpolated_and_optimistic_above():
    costs = costs_of({1: 0.030, 5: 0.050})
    assert costs.estimate(0) is None
    assert costs.estimate(3) == pytest.approx(0.040)
    assert costs.estimate(40) == pytest.approx(0.050)  # never measured above: the largest
    costs.observe(5, 0.060)
    assert costs.estimate(5) == pytest.approx(0.050 + COST_DECAY * 0.010)


def test_without_a_measured_plain_step_every_draft_stays():
    drafts = chains([[1, 2, 3], [4]])
    plan_drafts(drafts, [0.01, 0.01], costs_of({8: 0.1}))
    assert tokens(drafts) == [[1, 2, 3], [4]]


def test_drafts_likely_accepted_are_kept_where_rows_are_cheap():
    costs = costs_of({1: 0.030, 4: 0.039, 16: 0.063})  # a CPU's few-row kernels
    drafts = chains([[1, 2, 3]])
    plan_drafts(drafts, [0.9], costs)
    assert tokens(drafts) == [[1, 2, 3]]


def test_drafts_unlikely_accepted_are_dropped_and_the_step_decodes_plainly():
    costs = costs_of({1: 0.030, 4: 0.039})
    drafts = chains([[1, 2, 3]])
    plan_drafts(drafts, [0.05], costs)
    assert tokens(drafts) == [[]]


def test_a_batch_keeps_the_likely_drafts_and_drops_the_unlikely_ones():
    costs = costs_of({4: 0.040, 8: 0.046, 16: 0.080})
    drafts = chains([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]])
    plan_drafts(drafts, [0.95, 0.9, 0.1, 0.05], costs)
    assert [len(d) for d in drafts] == [3, 3, 0, 0]
    assert drafts[0].tokens == [1, 2, 3]  # a draft is cut at its end, never in its middle


def test_where_every_row_costs_as_much_as_a_step_nothing_pays():
    costs = costs_of({n: 0.010 * n for n in range(1, 20)})  # rows cost linearly
    drafts = chains([[1, 2], [3, 4]])
    plan_drafts(drafts, [0.8, 0.8], costs)
    assert tokens(drafts) == [[], []]


def test_the_acceptance_rate_follows_what_was_accepted():
    length = DraftLength(limit=4)
    assert length.rate == pytest.approx(0.5)  # the prior
    for _ in range(8):
        length.observe(4, 4)
    assert length.rate > 0.9
    for _ in range(8):
        length.observe(2, 0)
    assert length.rate < 0.2


def test_a_scheduler_that_plans_by_measured_costs_stays_exact(scheduler_for):
    """With step costs measured, the plan cuts drafts by them; whatever it keeps, the
    outputs are those of plain decoding. (Kernels are not chosen by timing here, so that
    both schedulers sum alike; only the plan reads the clock.)"""
    rng = random.Random(5)
    prompts = []
    for _ in range(12):
        span = [rng.randrange(3, 300) for _ in range(rng.randint(3, 10))]
        prompts.append(span * 3)
    base = {"num_threads": 1, "chunked_prefill_step_ms": None, "disable_adaptive_timing": True}
    plain = scheduler_for(**base)
    spec = scheduler_for(**base, speculative_algorithm="NGRAM")
    spec.speculation.costs = StepCosts()  # plan from the start
    try:
        outputs = []
        for scheduler in (plain, spec):
            reqs = [scheduler_req(scheduler, p, greedy(24)) for p in prompts]
            for req in reqs:  # one at a time: plain steps of one row get measured
                run_to_completion(scheduler, [req])
            outputs.append([req.output_ids for req in reqs])
        assert outputs[0] == outputs[1]
        assert 1 in spec.speculation.costs.rows  # plain one-row steps were measured
        assert len(spec.speculation.costs.rows) > 1  # and verify steps of more rows
        assert spec.server_info()["stats"]["spec_verify_steps"] > 0
    finally:
        spec.speculation.costs = None
