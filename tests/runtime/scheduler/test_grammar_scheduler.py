"""Constrained requests through the in-process scheduler on the tiny model: every output is
in its grammar whatever the sampling parameters, with jump-forward on and off, through
retraction, the radix cache, pages and static batching; requests wait for their grammar
without holding anything; jump-forward saves decode steps."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from runtime_checks import run_to_completion, scheduler_req
from workloads import random_ids

from radixlm.runtime.grammar.constraints import GrammarKey
from radixlm.runtime.request import Req
from radixlm.runtime.sampling.sampling_params import SamplingParams

REGEX = r"(yes|no), the (quick|lazy) [a-z]{2,6} number [0-9]{1,3}\."
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
}
EBNF = 'root ::= "The answer is " ("yes" | "no") " because " [a-z]{1,5} "."'
EBNF_TEXT = re.compile(r"The answer is (yes|no) because [a-z]{1,5}\.")

SAMPLING = [
    {"temperature": 0.7},
    {"temperature": 0.0},
    {"temperature": 1.0, "top_p": 0.8, "top_k": 20, "min_p": 0.05},
    {"temperature": 0.9, "frequency_penalty": 1.5, "presence_penalty": 0.5,
     "repetition_penalty": 1.3},
    {"temperature": 0.8, "logit_bias": {"3": 50.0}, "sampling_seed": 7},
    {"temperature": 0.7, "min_new_tokens": 30},
    {"temperature": 0.7, "ignore_eos": True},
]


def text_of(scheduler, req: Req) -> str:
    return scheduler.sampling_step.tokenizer.decode(req.output_ids, skip_special_tokens=True)


def assert_valid(scheduler, req: Req, kind: str) -> None:
    assert req.finish_reason is not None and req.finish_reason["type"] == "stop", req.finish_reason
    text = text_of(scheduler, req)
    if kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    else:
        assert EBNF_TEXT.fullmatch(text), text


def finish(scheduler, req: Req, max_steps: int = 1000) -> None:
    """Steps until ``req`` (already added) has finished."""
    for _ in range(max_steps):
        if req.finished:
            return
        scheduler.step()
    scheduler.abort(req)
    raise AssertionError(f"{req.rid} unfinished after {max_steps} steps")


def constrained(kind: str, **params) -> dict:
    text = {"regex": REGEX, "json_schema": json.dumps(SCHEMA), "ebnf": EBNF}[kind]
    return {"max_new_tokens": 200, kind: text, **params}


@pytest.mark.parametrize("jump_forward", [True, False], ids=["jump", "no-jump"])
def test_every_output_is_in_its_grammar_under_every_sampling_parameter(
    scheduler_for, jump_forward
):
    scheduler = scheduler_for(disable_jump_forward=not jump_forward)
    reqs, kinds = [], []
    for index, params in enumerate(SAMPLING):
        for kind in ("regex", "json_schema", "ebnf"):
            prompt = random_ids(index * 3 + len(kind), 12)
            reqs.append(scheduler_req(scheduler, prompt, constrained(kind, **params)))
            kinds.append(kind)
    run_to_completion(scheduler, reqs)
    for req, kind in zip(reqs, kinds):
        assert_valid(scheduler, req, kind)
    min_tokens = [r for r, k in zip(reqs, kinds) if r.sampling.min_new_tokens and k == "regex"]
    assert all(r.finish_reason["type"] == "stop" for r in min_tokens)
    jumped = sum(r.jump_forward_tokens for r in reqs)
    assert (jumped > 0) == jump_forward


def test_jump_forward_saves_decode_steps_and_keeps_greedy_text(scheduler_for):
    prompts = [random_ids(seed, 10) for seed in range(6)]
    runs = {}
    for jump_forward in (False, True):
        scheduler = scheduler_for(disable_jump_forward=not jump_forward)
        steps_before = scheduler.state.stats.decode_steps
        reqs = [scheduler_req(scheduler, p, constrained("json_schema", temperature=0.0))
                for p in prompts]
        run_to_completion(scheduler, reqs)
        runs[jump_forward] = (reqs, scheduler.state.stats.decode_steps - steps_before, scheduler)
    (plain, plain_steps, scheduler), (jumped, jump_steps, _) = runs[False], runs[True]
    for before, after in zip(plain, jumped):
        assert_valid(scheduler, after, "json_schema")
        assert text_of(scheduler, before) == text_of(scheduler, after)
        assert after.jump_forward_tokens > 0 and before.jump_forward_tokens == 0
        assert len(after.output_ids) == len(before.output_ids)
    assert jump_steps <= 0.7 * plain_steps, (jump_steps, plain_steps)


@pytest.mark.parametrize("options", [
    {"page_size": 4},
    {"batching": "static"},
    {"disable_radix_cache": True},
    {"schedule_policy": "fcfs", "chunked_prefill_size": 8},
], ids=["pages", "static", "no-cache", "chunked"])
def test_constrained_requests_run_under_every_scheduling_mode(scheduler_for, options):
    scheduler = scheduler_for(**options)
    reqs = [scheduler_req(scheduler, random_ids(seed, 20), constrained(kind, temperature=0.7))
            for seed in range(3) for kind in ("regex", "json_schema", "ebnf")]
    run_to_completion(scheduler, reqs)
    for req, kind in zip(reqs, ["regex", "json_schema", "ebnf"] * 3):
        assert_valid(scheduler, req, kind)


def test_retracted_constrained_requests_resume_their_grammar(scheduler_for):
    """A pool so small that decoding retracts: the matcher, which has accepted the output
    kept through retraction, continues where it was; greedy outputs equal a big pool's."""
    prompts = [random_ids(seed, 30) for seed in range(16)]
    params = constrained("json_schema", temperature=0.0)
    big = scheduler_for()
    expected = [scheduler_req(big, p, params) for p in prompts]
    run_to_completion(big, expected)
    small = scheduler_for(max_total_tokens=400, init_new_token_ratio=0.01,
                          min_new_token_ratio=0.01, new_token_ratio_decay=0.5)
    retractions = small.state.stats.retractions
    reqs = [scheduler_req(small, p, params) for p in prompts]
    run_to_completion(small, reqs)
    assert small.state.stats.retractions > retractions
    assert any(r.retractions for r in reqs)
    for req, reference in zip(reqs, expected):
        assert_valid(small, req, "json_schema")
        assert req.output_ids == reference.output_ids


def test_a_repeated_constrained_prompt_reuses_the_cache_and_its_compiled_grammar(scheduler_for):
    scheduler = scheduler_for()
    prompt = random_ids(99, 40)
    first = scheduler_req(scheduler, prompt, constrained("regex", temperature=0.0))
    run_to_completion(scheduler, [first])
    second = scheduler_req(scheduler, prompt, constrained("regex", temperature=0.0))
    scheduler.add_request(second)
    assert second.grammar is not None and second in scheduler.state.waiting, "a cache hit: no queue"
    finish(scheduler, second)
    assert second.cached_tokens == len(prompt) - 1
    assert second.output_ids == first.output_ids
    assert_valid(scheduler, second, "regex")


def test_requests_wait_for_their_grammar_without_holding_memory(scheduler_for):
    scheduler = scheduler_for()
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "title": "unique-to-this-test"}
    req = scheduler_req(scheduler, random_ids(5, 10),
                        {"max_new_tokens": 50, "json_schema": json.dumps(schema)})
    scheduler.add_request(req)
    if req.grammar is None:  # still compiling: queued, holding no row
        assert req in scheduler.grammar_queue.reqs() and req.req_pool_idx is None
        assert not scheduler.is_idle() and req in scheduler.requests()
    finish(scheduler, req)
    assert json.loads(text_of(scheduler, req))["n"] is not None


def test_aborting_a_request_waiting_for_its_grammar_removes_it(scheduler_for):
    scheduler = scheduler_for()
    req = scheduler_req(scheduler, random_ids(6, 10), constrained("regex"))
    req.grammar = None
    scheduler.grammar_queue.pending.append((req, scheduler.sampler.grammar_backend.compile(
        GrammarKey("regex", REGEX))))
    scheduler.abort(req)
    assert req.finish_reason["type"] == "abort" and not scheduler.grammar_queue.reqs()
    assert scheduler.is_idle()


def test_a_grammar_that_fails_to_compile_ends_its_request_with_the_reason(scheduler_for):
    """The Engine refuses bad constraints before sending them; the scheduler still copes with
    one that arrives (a request built without SamplingParams' checks)."""
    scheduler = scheduler_for()
    req = Req("bad-grammar", random_ids(7, 10), SamplingParams(max_new_tokens=5),
              grammar_key=GrammarKey("regex", "foo**"))
    scheduler.add_request(req)
    stepped = []
    for _ in range(200):
        stepped += scheduler.step()
        if req.finished:
            break
    assert req in stepped and req.finish_reason["type"] == "abort"
    assert "regex" in req.finish_reason["message"] and scheduler.is_idle()
