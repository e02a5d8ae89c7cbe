"""Retraction: when decode would run out of KV, running requests give their KV back, wait, and
are recomputed later. Every request still completes, with exactly the tokens it would have
produced alone, and its stream never goes back on tokens it already showed."""

from __future__ import annotations

import functools
import random

import pytest
from runtime_checks import assert_engine_idle, run_to_completion, scheduler_req
from workloads import greedy, random_ids

NUM_REQUESTS = 300
# Far too small for the workload at once: ~12 average requests (prompt + output) fill it, and
# admission reserves only a ratio of each running request's remaining output budget.
SMALL_POOL = dict(max_total_tokens=1024, max_running_requests=64)
# Admission that reserves almost nothing for running requests' remaining output, and goes back
# to that quickly after each retraction: dozens of retractions, some requests retracted twice.
BOLD = dict(init_new_token_ratio=0.01, min_new_token_ratio=0.01, new_token_ratio_decay=0.5)


@functools.lru_cache(maxsize=1)
def workload() -> tuple[list[list[int]], list[dict]]:
    """300 random prompts of 5-120 tokens with greedy budgets of 1-48 tokens (seeded)."""
    rng = random.Random(1234)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(5, 120))]
               for _ in range(NUM_REQUESTS)]
    params = [greedy(rng.randint(1, 48)) for _ in range(NUM_REQUESTS)]
    return prompts, params


_REFERENCE: list[list[int]] = []


def reference_outputs(engine_for) -> list[list[int]]:
    """Each request's tokens on a pool big enough for everything (no retraction possible).

    The first 30 run truly one by one; the rest in generate calls of 30 (greedy tokens do
    not depend on the batch, which other tests check), once per session.
    """
    if not _REFERENCE:
        big = engine_for()
        prompts, params = workload()
        alone = 30
        for prompt, param in zip(prompts[:alone], params[:alone]):
            _REFERENCE.append(big.generate(input_ids=prompt, sampling_params=param)["output_ids"])
        for start in range(alone, NUM_REQUESTS, 30):
            outs = big.generate(input_ids=prompts[start : start + 30],
                                sampling_params=params[start : start + 30])
            _REFERENCE.extend(o["output_ids"] for o in outs)
            assert all(o["meta_info"]["total_retractions"] == 0 for o in outs)
    return _REFERENCE


def run(scheduler, prompts, params, **fields) -> list:
    """Runs requests straight on an in-process scheduler; returns its finished ``Req``s."""
    reqs = [scheduler_req(scheduler, p, s, **fields) for p, s in zip(prompts, params)]
    run_to_completion(scheduler, reqs, max_steps=20_000)
    return reqs


# Through the Engine ------------------------------------------------------------------------------


@pytest.mark.slow  # (the tests below retract in the default stage)
@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
def test_requests_retracted_when_the_pool_runs_out_all_complete_with_their_own_tokens(
    engine_for, policy
):
    expected = reference_outputs(engine_for)
    engine = engine_for(schedule_policy=policy, **SMALL_POOL)
    assert engine.get_server_info()["schedule_policy"] == policy
    engine.flush_cache()
    prompts, params = workload()
    retractions_before = engine.get_server_info()["stats"]["retractions"]
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert len(outs) == NUM_REQUESTS
    for out, param in zip(outs, params):
        budget = param["max_new_tokens"]
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": budget}
        assert out["meta_info"]["completion_tokens"] == budget
    mismatched = [i for i, out in enumerate(outs) if out["output_ids"] != expected[i]]
    assert not mismatched, f"{len(mismatched)} requests differ from their run alone"
    retractions = sum(out["meta_info"]["total_retractions"] for out in outs)
    assert retractions > 0, "the workload never needed a retraction: it tests nothing"
    assert engine.get_server_info()["stats"]["retractions"] - retractions_before == retractions
    # Retracted requests hold nothing once they are done.
    assert_engine_idle(engine)


@pytest.mark.slow  # 13 s; the other retraction tests keep retraction in the default run
def test_a_retracted_stream_never_takes_back_tokens_it_showed(engine_for):
    expected = reference_outputs(engine_for)
    engine = engine_for(schedule_policy="lpm", **SMALL_POOL, **BOLD)
    engine.flush_cache()
    prompts, params = workload()
    shown: dict[int, list[int]] = {}
    texts: dict[int, str] = {}
    finals: dict[int, dict] = {}
    for chunk in engine.generate(input_ids=prompts, sampling_params=params, stream=True):
        index = chunk["index"]
        assert index not in finals, "a chunk came after the request's final chunk"
        before = shown.get(index, [])
        assert chunk["output_ids"][: len(before)] == before, "a stream took back tokens"
        assert chunk["text"].startswith(texts.get(index, ""))
        shown[index], texts[index] = chunk["output_ids"], chunk["text"]
        if chunk["meta_info"]["finish_reason"] is not None:
            finals[index] = chunk
    assert sorted(finals) == list(range(NUM_REQUESTS))
    assert sum(c["meta_info"]["total_retractions"] for c in finals.values()) > 0
    assert [finals[i]["output_ids"] for i in range(NUM_REQUESTS)] == expected


def test_requests_that_never_retract_report_zero_retractions(engine_for):
    prompts, params = workload()
    outs = engine_for().generate(input_ids=prompts[:20], sampling_params=params[:20])
    assert [o["meta_info"]["total_retractions"] for o in outs] == [0] * 20


# On the scheduler ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "page_size", "ratios"),
    [("lpm", 4, {}), pytest.param("lpm", 1, BOLD, marks=pytest.mark.slow),
     ("fcfs", 4, BOLD), pytest.param("dfs-weight", 1, BOLD, marks=pytest.mark.slow)],
    ids=["lpm-page4", "lpm-bold", "fcfs-page4-bold", "dfs-weight-bold"],
)
def test_retraction_on_any_page_size_and_ratio_keeps_every_request_s_tokens(
    engine_for, scheduler_for, policy, page_size, ratios
):
    expected = reference_outputs(engine_for)
    scheduler = scheduler_for(schedule_policy=policy, page_size=page_size, **SMALL_POOL, **ratios)
    scheduler.memory.flush()
    prompts, params = workload()
    before = scheduler.state.stats.retractions
    reqs = run(scheduler, prompts, params)
    assert [r.finish_reason["type"] for r in reqs] == ["length"] * NUM_REQUESTS
    mismatched = [i for i, r in enumerate(reqs) if r.output_ids != expected[i]]
    assert not mismatched, f"{len(mismatched)} requests differ from their run alone"
    assert sum(r.retractions for r in reqs) == scheduler.state.stats.retractions - before > 0


def _values(entries: list) -> list[float]:
    return [entry[0] for entry in entries]


def test_a_retracted_request_keeps_its_prompt_and_output_logprobs(engine_for, scheduler_for):
    """Recomputing a retracted request must not add, drop or change any of its logprobs."""
    prompts, params = workload()
    want = engine_for().generate(input_ids=prompts[:150], sampling_params=params[:150],
                                 return_logprob=True, logprob_start_len=2, top_logprobs_num=2)
    scheduler = scheduler_for(schedule_policy="lpm", **SMALL_POOL, **BOLD)
    got = run(scheduler, prompts[:150], params[:150], return_logprob=True, logprob_start=2,
              top_logprobs_num=2)
    assert sum(r.retractions for r in got) > 0
    for req, theirs in zip(got, want):
        meta = theirs["meta_info"]
        assert req.output_ids == theirs["output_ids"]
        for ours, key in ((req.input_token_logprobs, "input_token_logprobs"),
                          (req.output_token_logprobs, "output_token_logprobs")):
            assert [e[1] for e in ours] == [e[1] for e in meta[key]], key
            assert _values(ours) == pytest.approx(_values(meta[key]), abs=1e-5), key
        for ours, key in ((req.input_top_logprobs, "input_top_logprobs"),
                          (req.output_top_logprobs, "output_top_logprobs")):
            assert len(ours) == len(meta[key]), key
            for mine, theirs_top in zip(ours, meta[key]):
                assert (mine is None) == (theirs_top is None), key
                if mine is not None:
                    assert [e[1] for e in mine] == [e[1] for e in theirs_top], key
                    assert _values(mine) == pytest.approx(_values(theirs_top), abs=1e-5), key


def test_long_prompts_prefilled_in_chunks_under_retraction_keep_tokens_and_logprobs(
    engine_for, scheduler_for
):
    rng = random.Random(3)
    prompts = [random_ids(50 + i, rng.randint(40, 200)) for i in range(40)]
    params = [greedy(rng.randint(1, 40)) for _ in prompts]
    want = engine_for().generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                                 logprob_start_len=3)
    scheduler = scheduler_for(max_total_tokens=512, chunked_prefill_size=16, **BOLD)
    scheduler.memory.flush()
    got = run(scheduler, prompts, params, return_logprob=True, logprob_start=3)
    assert sum(r.retractions for r in got) > 0
    for req, theirs in zip(got, want):
        assert req.output_ids == theirs["output_ids"]
        entries = theirs["meta_info"]["input_token_logprobs"]
        assert len(req.input_token_logprobs) == len(entries)
        assert _values(req.input_token_logprobs) == pytest.approx(_values(entries), abs=1e-5)


def test_static_batching_under_retraction_completes_with_the_reference_tokens(
    engine_for, scheduler_for
):
    expected = reference_outputs(engine_for)
    scheduler = scheduler_for(batching="static", **SMALL_POOL, **BOLD)
    prompts, params = workload()
    reqs = run(scheduler, prompts[:100], params[:100])
    assert sum(r.retractions for r in reqs) > 0
    assert [r.output_ids for r in reqs] == expected[:100]
