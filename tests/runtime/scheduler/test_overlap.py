"""Overlap scheduling: a decode step queued behind the one in flight gives exactly the outputs
of the plain loop (tokens, finish reasons, logprobs, constrained text), under stop tokens and
strings, penalties, chunked prefill, retraction and abort, and leaves the pool idle."""

from __future__ import annotations

import random

import pytest
from runtime_checks import assert_engine_idle, run_to_completion, scheduler_req
from workloads import greedy, random_ids, sampled

# One CPU thread for both loops: results then depend on the batches alone (with the thread
# count chosen by timing, as by default, the last bits of a logprob may differ run to run).
# On CPUs the plain loop is the default: overlap is asked for.
OVERLAP = {"num_threads": 1, "disable_overlap_schedule": False}
PLAIN = {**OVERLAP, "disable_overlap_schedule": True}
SMALL_POOL = {"max_total_tokens": 1024, "init_new_token_ratio": 0.01,
              "min_new_token_ratio": 0.01, "new_token_ratio_decay": 0.5}
CHUNKED = {"chunked_prefill_size": 32}


def mixed_workload(count: int, seed: int) -> tuple[list[list[int]], list[dict]]:
    """Requests of every kind the runtime serves: greedy with and without stops, penalties,
    seeded sampling, ``min_new_tokens``, a JSON constraint; budgets of 1-40 tokens (12 for
    the constrained ones)."""
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(count):
        prompts.append(random_ids(seed * 1000 + i, rng.randint(4, 90)))
        budget = rng.randint(1, 40)
        kind = i % 8
        if kind == 0:
            params.append(greedy(budget))
        elif kind == 1:  # ends early on a frequent token
            params.append(greedy(budget, stop_token_ids=[rng.randrange(3, 60)]))
        elif kind == 2:
            params.append(greedy(budget, stop=["e", "an"]))
        elif kind == 3:
            params.append(greedy(budget, frequency_penalty=0.8, presence_penalty=0.3,
                                 repetition_penalty=1.3))
        elif kind == 4:
            params.append(sampled(seed + i, budget))
        elif kind == 5:
            params.append(greedy(budget, min_new_tokens=budget // 2))
        elif kind == 6:
            params.append({"temperature": 0.0, "max_new_tokens": 12,
                           "json_schema": '{"type": "object", "properties": '
                                          '{"a": {"type": "integer"}}, "required": ["a"]}'})
        else:
            params.append(greedy(budget, ignore_eos=False))
    return prompts, params


def run(scheduler, prompts, params, **fields):
    reqs = [scheduler_req(scheduler, p, s, **fields) for p, s in zip(prompts, params)]
    run_to_completion(scheduler, reqs, max_steps=20_000)
    return reqs


def outcome(reqs) -> list[tuple]:
    return [(r.output_ids, r.finish_reason) for r in reqs]


@pytest.mark.parametrize("options", [{}, CHUNKED, SMALL_POOL], ids=["plain", "chunked",
                                                                       "retracting"])
def test_overlap_gives_the_plain_loop_outputs(scheduler_for, options):
    prompts, params = mixed_workload(64, seed=len(options))
    expected = outcome(run(scheduler_for(**PLAIN, **options), prompts, params))
    overlapped = scheduler_for(**OVERLAP, **options)
    before = overlapped.state.stats.overlapped_steps
    assert outcome(run(overlapped, prompts, params)) == expected
    assert overlapped.state.stats.overlapped_steps > before, "no decode step ran ahead"
    if options is SMALL_POOL:
        assert overlapped.state.stats.retractions > 0


def test_overlap_runs_greedy_batches_ahead_and_ends_every_request_once(scheduler_for):
    prompts = [random_ids(50 + i, 20) for i in range(12)]
    params = [greedy(5 + 3 * i) for i in range(12)]
    expected = outcome(run(scheduler_for(**PLAIN), prompts, params))
    scheduler = scheduler_for(**OVERLAP)
    reqs = [scheduler_req(scheduler, p, s) for p, s in zip(prompts, params)]
    for req in reqs:
        scheduler.add_request(req)
    reported: dict[str, int] = {}
    steps_ahead = 0
    while not scheduler.is_idle():
        for req in scheduler.step():
            if req.finished:
                reported[req.rid] = reported.get(req.rid, 0) + 1
        steps_ahead += scheduler.state.in_flight is not None
    assert outcome(reqs) == expected
    assert reported == {req.rid: 1 for req in reqs}, "each end is reported exactly once"
    assert steps_ahead > 30
    assert len(scheduler.state.sampling_batch) == 0


CONSTRAINTS = [  # long free text under a mask; forced text (jump-forward) between choices
    {"regex": r"(yes|no), the (quick|lazy) [a-z ]{20,40} number [0-9]{1,3}\."},
    {"ebnf": 'root ::= "The answer is " ("yes" | "no") " because " [a-z]{1,5} "."'},
    {"json_schema": '{"type": "object", "properties": {"name": {"type": "string", '
                    '"maxLength": 6}, "colour": {"enum": ["red", "green"]}}, '
                    '"required": ["name", "colour"]}'},
]


def test_constrained_requests_run_ahead_with_the_plain_loop_outputs(scheduler_for):
    """Grammars (whose matchers accept each token on the host while the next step's forward
    pass runs) and jump-forward (whose forced text a step run ahead did not compute) give
    the plain loop's tokens, greedy, seeded and penalised, beside unconstrained requests."""
    prompts = [random_ids(300 + i, 6 + 5 * i) for i in range(12)]
    settings = [{"temperature": 0.0}, {"temperature": 0.8, "sampling_seed": 11},
                {"temperature": 0.0, "frequency_penalty": 0.7, "min_new_tokens": 3}]
    params = [{"max_new_tokens": 60, **CONSTRAINTS[i % 3], **settings[i // 3 % 3]}
              for i in range(9)] + [greedy(40), greedy(25, stop=["e"]), sampled(4, 30)]
    plain = scheduler_for(**PLAIN)
    expected = run(plain, prompts, params)
    overlapped = scheduler_for(**OVERLAP)
    got = [scheduler_req(overlapped, p, s) for p, s in zip(prompts, params)]
    for req in got:
        overlapped.add_request(req)
    constrained_ahead = 0  # steps queued ahead with a constrained request in them
    while not overlapped.is_idle():
        overlapped.step()
        flight = overlapped.state.in_flight
        constrained_ahead += flight is not None and any(r.grammar for r in flight.reqs)
    assert outcome(got) == outcome(expected)
    assert [r.jump_forward_tokens for r in got] == [r.jump_forward_tokens for r in expected]
    assert sum(r.jump_forward_tokens for r in got) > 0, "no jump-forward to check"
    assert all(r.finish_reason["type"] == "stop" for r in got[:9])
    assert constrained_ahead > 10, "constrained requests ran in the plain loop only"
    assert len(overlapped.state.sampling_batch) == 0


def test_logprobs_are_the_plain_loop_values(scheduler_for):
    """Prompt logprobs (computed in the extend step) and output logprobs (on the worker, in
    the steps run ahead) equal the plain loop's, bit for bit."""
    prompts = [random_ids(70 + i, 15) for i in range(6)]
    params = [greedy(12), sampled(5, 12), greedy(9, stop_token_ids=[40, 41, 42])] * 2
    fields = {"return_logprob": True, "top_logprobs_num": 2, "logprob_start": 3}
    expected = run(scheduler_for(**PLAIN), prompts, params, **fields)
    overlapped = scheduler_for(**OVERLAP)
    before = overlapped.state.stats.overlapped_steps
    got = run(overlapped, prompts, params, **fields)
    assert overlapped.state.stats.overlapped_steps > before
    assert outcome(got) == outcome(expected)
    for ours, theirs in zip(got, expected):
        assert ours.output_token_logprobs == theirs.output_token_logprobs
        assert ours.input_token_logprobs == theirs.input_token_logprobs
        assert ours.output_top_logprobs == theirs.output_top_logprobs


def test_aborting_while_a_step_is_in_flight_frees_everything(scheduler_for):
    prompts = [random_ids(90 + i, 25) for i in range(6)]
    params = [greedy(60) for _ in range(6)]
    expected = outcome(run(scheduler_for(**PLAIN), prompts, params))
    scheduler = scheduler_for(**OVERLAP)
    reqs = [scheduler_req(scheduler, p, s) for p, s in zip(prompts, params)]
    for req in reqs:
        scheduler.add_request(req)
    while scheduler.state.in_flight is None or len(reqs[2].output_ids) < 10:
        scheduler.step()
    scheduler.abort(reqs[2], "stop it")
    assert reqs[2].finish_reason == {"type": "abort", "message": "stop it"}
    assert scheduler.state.in_flight is None and reqs[2] not in scheduler.state.sampling_batch
    while not scheduler.is_idle():
        scheduler.step()
    got = outcome(reqs)
    assert got[:2] + got[3:] == expected[:2] + expected[3:]
    assert expected[2][0][: len(got[2][0])] == got[2][0]


@pytest.mark.slow  # two engines (7 s); the scheduler-level tests above stay
def test_engine_streams_the_same_text_with_overlap_on_and_off(engine_for):
    prompts = [random_ids(120 + i, 12) for i in range(4)]
    params = [greedy(30, stop=["the"]), greedy(30, frequency_penalty=1.0), greedy(30),
              greedy(8)]

    def streamed(engine) -> dict[int, str]:
        """Each prompt's final text, checking that every chunk extends the one before."""
        texts: dict[int, str] = {}
        for chunk in engine.generate(input_ids=prompts, sampling_params=params, stream=True):
            assert chunk["text"].startswith(texts.get(chunk["index"], ""))
            texts[chunk["index"]] = chunk["text"]
        return texts

    overlapped = engine_for(**OVERLAP)
    assert streamed(overlapped) == streamed(engine_for(**PLAIN))
    assert_engine_idle(overlapped)
    assert overlapped.get_server_info()["stats"]["overlapped_steps"] > 0
