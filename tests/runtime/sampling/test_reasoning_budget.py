"""The thinking budget (``max_reasoning_tokens``): refused by name where it enters when
malformed; the end ids forced at the budget, one a step, unless they were written before;
nothing forced after them; rows without a budget untouched; the same under the overlap
scheduler, for n > 1, after jump-forward tokens, and where the logits forbid the due id."""

from __future__ import annotations

import re

import pytest
import torch
from runtime_checks import run_to_completion, scheduler_req
from workloads import PROMPTS, greedy, random_ids, sampled

from radixlm.runtime.request import Req
from radixlm.runtime.sampling.sampler import Sampler
from radixlm.runtime.sampling.sampling_params import SamplingParams

VOCAB = 8
EOS = 7

END = [41, 97]  # two arbitrary ids standing for ``</think>``'s
LIMIT = 5
BUDGET = {"max_reasoning_tokens": LIMIT, "reasoning_end_token_ids": END}
AVOID_END = {"logit_bias": {str(t): -100.0 for t in END}}
"""The end ids all but never sampled: where they appear, the budget forced them."""


def contains(output: list[int], sequence: list[int]) -> bool:
    return any(output[i:i + len(sequence)] == sequence for i in range(len(output)))


# Validation where a request enters ---------------------------------------------------------

@pytest.mark.parametrize(("params", "field"), [
    ({"max_reasoning_tokens": -1, "reasoning_end_token_ids": END}, "max_reasoning_tokens"),
    ({"max_reasoning_tokens": 2.5, "reasoning_end_token_ids": END}, "max_reasoning_tokens"),
    ({"max_reasoning_tokens": True, "reasoning_end_token_ids": END}, "max_reasoning_tokens"),
    ({"max_reasoning_tokens": 5}, "reasoning_end_token_ids"),
    ({"max_reasoning_tokens": 5, "reasoning_end_token_ids": []}, "reasoning_end_token_ids"),
    ({"max_reasoning_tokens": 5, "reasoning_end_token_ids": [3, -1]},
     "reasoning_end_token_ids"),
    ({"reasoning_end_token_ids": "</think>"}, "reasoning_end_token_ids"),
    ({"max_reasoning_tokens": 5, "reasoning_end_token_ids": [1] * 33},
     "reasoning_end_token_ids"),
])
def test_a_malformed_budget_is_refused_naming_the_field(params, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict(params)


def test_a_budget_is_kept_and_its_ids_must_lie_in_the_vocabulary():
    params = SamplingParams.from_dict({"max_reasoning_tokens": 0,
                                       "reasoning_end_token_ids": [3, 400]})
    assert (params.max_reasoning_tokens, params.reasoning_end_token_ids) == (0, [3, 400])
    params.check_vocab(1000)
    with pytest.raises(ValueError, match="400"):
        params.check_vocab(384)


def test_beam_search_refuses_a_budget():
    params = SamplingParams.from_dict({"use_beam_search": True, "n": 2, **BUDGET})
    assert params.beam_search_conflicts(set(BUDGET)) == ["max_reasoning_tokens"]


# The sampler, on hand-made logits ------------------------------------------------------------

def make_req(output_ids=(), **params) -> Req:
    req = Req(rid="r", input_ids=[1, 2, 3], sampling=SamplingParams.from_dict(params))
    req.output_ids = list(output_ids)
    return req


def favouring(token: int, rows: int = 1) -> torch.Tensor:
    logits = torch.zeros(rows, VOCAB)
    logits[:, token] = 5.0
    return logits


def run_sampler(reqs, steps: int, logits: torch.Tensor) -> list[list[int]]:
    """Each request's tokens over ``steps`` greedy steps from the same ``logits``."""
    sampler = Sampler(VOCAB, {EOS}, 0)
    batch = sampler.new_batch("cpu")
    batch.add(reqs)
    drawn = []
    for _ in range(steps):
        tokens = sampler.sample(logits, batch)
        batch.record_sampled(tokens)
        drawn.append(tokens.tolist())
    return [list(row) for row in zip(*drawn)]


def test_the_end_ids_are_forced_at_the_budget_then_sampling_is_free():
    budget = make_req(temperature=0.0, max_reasoning_tokens=2, reasoning_end_token_ids=[5, 6])
    [out] = run_sampler([budget], 6, favouring(1))
    assert out == [1, 1, 5, 6, 1, 1]


def test_a_budget_of_zero_forces_from_the_first_token():
    budget = make_req(temperature=0.0, max_reasoning_tokens=0, reasoning_end_token_ids=[5, 6])
    [out] = run_sampler([budget], 4, favouring(1))
    assert out == [5, 6, 1, 1]


def test_an_end_sequence_in_the_output_already_stops_any_forcing():
    # joining with it long written (a request re-admitted after a retraction)
    written = make_req(output_ids=[5, 6, 1, 1, 1], temperature=0.0, max_reasoning_tokens=5,
                       reasoning_end_token_ids=[5, 6])
    # only part of it written: still forced
    partial = make_req(output_ids=[6, 5, 1, 1, 5], temperature=0.0, max_reasoning_tokens=5,
                       reasoning_end_token_ids=[5, 6])
    assert run_sampler([written, partial], 3, favouring(1, rows=2)) == [[1, 1, 1], [5, 6, 1]]


def test_the_end_sequence_sampled_before_the_budget_stops_any_forcing():
    budget = make_req(temperature=0.0, max_reasoning_tokens=3, reasoning_end_token_ids=[2, 2])
    [out] = run_sampler([budget], 5, favouring(2))
    assert out == [2, 2, 2, 2, 2]  # the end sequence was written at once
    budget = make_req(temperature=0.0, max_reasoning_tokens=2, reasoning_end_token_ids=[2, 3])
    [out] = run_sampler([budget], 5, favouring(2))
    assert out == [2, 2, 2, 3, 2]  # "2" at 1 and 2 does not make "2 3": forced at 2 and 3


def test_a_sequence_completed_part_way_through_the_forcing_ends_it():
    # output ... 4, then 4 forced: "4 4" is the end sequence, nothing more is forced
    budget = make_req(output_ids=[1, 4], temperature=0.0, max_reasoning_tokens=2,
                      reasoning_end_token_ids=[4, 4, 3])
    [out] = run_sampler([budget], 3, favouring(1))
    assert out == [4, 4, 3]  # all three forced: "4 4" is not "4 4 3"
    budget = make_req(output_ids=[1, 4], temperature=0.0, max_reasoning_tokens=2,
                      reasoning_end_token_ids=[4, 4])
    [out] = run_sampler([budget], 3, favouring(1))
    assert out == [4, 1, 1]  # "4" then forced "4": done after one


def test_jump_forward_tokens_that_write_the_end_sequence_stop_the_forcing():
    sampler = Sampler(VOCAB, {EOS}, 0)
    batch = sampler.new_batch("cpu")
    req = make_req(temperature=0.0, max_reasoning_tokens=3, reasoning_end_token_ids=[5, 6])
    batch.add([req])
    batch.record_sampled(torch.tensor([1]))
    batch.record_appended(req, [5, 6])  # at positions 1, 2: before the budget
    assert sampler.sample(favouring(1), batch).tolist() == [1]


def test_a_due_id_the_logits_forbid_is_not_forced():
    budget = make_req(temperature=0.0, max_reasoning_tokens=0, reasoning_end_token_ids=[5])
    logits = favouring(1)
    logits[0, 5] = float("-inf")  # as a grammar that forbids it masks it
    [out] = run_sampler([budget], 1, logits)
    assert out == [1]


def test_rows_without_a_budget_are_sampled_as_if_alone():
    plain = [make_req(temperature=0.0), make_req(temperature=1.0, sampling_seed=3)]
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    budget = make_req(temperature=0.0, max_reasoning_tokens=0, reasoning_end_token_ids=[5])
    alone = run_sampler([make_req(temperature=0.0),
                         make_req(temperature=1.0, sampling_seed=3)], 3, logits[[0, 2]])
    mixed = run_sampler([plain[0], budget, plain[1]], 3, logits)
    assert [mixed[0], mixed[2]] == alone
    assert mixed[1][0] == 5


# End to end, on a tiny random model ----------------------------------------------------------

def test_a_sampled_output_has_the_end_ids_at_the_budget_and_nowhere_else(engine_for):
    engine = engine_for()
    for seed in range(4):
        out = engine.generate(PROMPTS[seed], sampled(seed, 16, **BUDGET, **AVOID_END))
        ids = out["output_ids"]
        assert len(ids) == 16
        assert ids[LIMIT:LIMIT + 2] == END, ids
        assert [i for i, t in enumerate(ids) if t in END] == [LIMIT, LIMIT + 1], ids
        free = engine.generate(PROMPTS[seed], sampled(seed, 16, **AVOID_END))["output_ids"]
        assert free[:LIMIT] == ids[:LIMIT]  # same seed, same tokens before the budget
        assert not set(free) & set(END)


def test_an_end_sequence_written_before_the_budget_is_not_forced_again(engine_for):
    engine = engine_for()
    free = engine.generate(PROMPTS[1], greedy(12))["output_ids"]
    end = free[1:3]  # the model writes these itself at 1..2
    assert free[LIMIT:LIMIT + 2] != end
    params = greedy(12, max_reasoning_tokens=LIMIT, reasoning_end_token_ids=end)
    assert engine.generate(PROMPTS[1], params)["output_ids"] == free


def test_batched_with_requests_without_a_budget_they_are_unchanged(engine_for):
    engine = engine_for()
    plain = [greedy(12), greedy(9, frequency_penalty=0.5), greedy(12, temperature=0.0)]
    alone = [engine.generate(PROMPTS[i], p)["output_ids"] for i, p in enumerate(plain)]
    budget = greedy(12, **BUDGET, **AVOID_END)
    outs = engine.generate([PROMPTS[0], PROMPTS[3], PROMPTS[1], PROMPTS[2]],
                           [plain[0], budget, plain[1], plain[2]])
    assert [outs[0]["output_ids"], outs[2]["output_ids"], outs[3]["output_ids"]] == alone
    assert outs[1]["output_ids"][LIMIT:LIMIT + 2] == END


def test_each_of_n_samples_has_its_own_budget(engine_for):
    outs = engine_for().generate(PROMPTS[0], sampled(None, 12, n=2, **BUDGET, **AVOID_END))
    assert len(outs) == 2 and outs[0]["output_ids"] != outs[1]["output_ids"]
    for out in outs:
        ids = out["output_ids"]
        assert [i for i, t in enumerate(ids) if t in END] == [LIMIT, LIMIT + 1], ids
        assert ids[LIMIT:LIMIT + 2] == END


def test_a_grammar_that_forbids_the_end_ids_wins(engine_for):
    engine = engine_for()
    digit = engine.tokenizer.convert_tokens_to_ids("7")
    params = greedy(10, regex="[a-z]{10}", max_reasoning_tokens=2,
                    reasoning_end_token_ids=[digit])
    out = engine.generate(PROMPTS[0], params)
    assert out["meta_info"]["finish_reason"]["type"] != "abort"
    assert re.fullmatch("[a-z]{10}", out["text"]) and digit not in out["output_ids"]
    allowed = engine.generate(PROMPTS[0], {**params, "regex": "[a-z7]{10}"})
    assert allowed["output_ids"][2] == digit


OVERLAP = {"num_threads": 1, "disable_overlap_schedule": False}
PLAIN = {**OVERLAP, "disable_overlap_schedule": True}


def test_the_overlap_scheduler_gives_the_plain_loop_outputs(scheduler_for):
    prompts = [random_ids(700 + i, 6 + 5 * i) for i in range(8)]
    params = []
    for i in range(8):
        budget = {"max_reasoning_tokens": i % 4 * 3, "reasoning_end_token_ids": END[: 1 + i % 2]}
        if i % 3 == 0:
            params.append(greedy(14))  # no budget, beside the others
        else:
            params.append(sampled(i, 14, **budget, **AVOID_END))

    def run(scheduler):
        reqs = [scheduler_req(scheduler, p, s) for p, s in zip(prompts, params)]
        run_to_completion(scheduler, reqs, max_steps=5_000)
        return [r.output_ids for r in reqs]

    expected = run(scheduler_for(**PLAIN))
    overlapped = scheduler_for(**OVERLAP)
    before = overlapped.state.stats.overlapped_steps
    assert run(overlapped) == expected
    assert overlapped.state.stats.overlapped_steps > before, "no decode step ran ahead"
    for ids, p in zip(expected, params):
        if "max_reasoning_tokens" in p:
            limit, end = p["max_reasoning_tokens"], p["reasoning_end_token_ids"]
            assert ids[limit:limit + len(end)] == end
            assert [t for t in ids if t in END] == end
