"""Speculative decoding's exactness (radixlm/runtime/scheduler/speculative_decode.py): with
n-gram drafts (from the request's own tokens and from the radix tree) or a draft model's
(STANDALONE: the target itself, or another random model that is almost never right) verified
in one pass, greedy and seeded outputs equal those of decoding without speculation, token
for token, alone and batched, under stops, logprobs, grammars, n > 1, chunked prefill, pages
of four tokens, overlap and retraction; unseeded sampling keeps the target's distribution (a
chi-square test against transformers' probabilities); the KV of rejected draft tokens is
given back at once (checked between every two steps), and a verify or draft pass that fails
leaks nothing.

Random tiny models rarely repeat themselves, so the prompts here repeat a random span two or
three times: n-gram drafts then fire, some are accepted and some rejected, which each test
checks in the scheduler's counters (a test where no draft was rejected would prove little).
"""

from __future__ import annotations

import functools
import random
import uuid

import pytest
import torch
from runtime_checks import assert_engine_idle, run_to_completion, scheduler_req
from tiny_models import reference_model
from workloads import greedy, sampled

from radixlm.kv_cache.allocator import pages_for
from radixlm.models.default_model import default_model_path
from radixlm.runtime import messages as wire
from radixlm.runtime.sampling.sampling_params import SamplingParams
from radixlm.runtime.scheduler.scheduler_process import build_scheduler, make_req
from radixlm.runtime.server_args import ServerArgs

# One thread and no kernel chosen by timing: both schedulers of a comparison then compute
# the same float32 sums (greedy ties between them could otherwise flip).
BASE = {"num_threads": 1, "disable_adaptive_timing": True, "chunked_prefill_step_ms": None}
PLAIN = {**BASE}
SPEC = {**BASE, "speculative_algorithm": "NGRAM", "speculative_disable_by_batch_size": 512}
TREE = {**SPEC, "speculative_ngram_max_bfs_breadth": 4, "speculative_num_draft_tokens": 9}
SMALL_POOL = {"max_total_tokens": 1024, "max_running_requests": 64,
              "init_new_token_ratio": 0.01, "min_new_token_ratio": 0.01,
              "new_token_ratio_decay": 0.5}
NUM_PROMPTS = 200
VOCAB = 300
COUNTERS = ("spec_verify_steps", "spec_drafted_requests", "spec_draft_tokens",
            "spec_accepted_tokens", "spec_accepted_branch_tokens", "retractions",
            "overlapped_steps")


@pytest.fixture(params=["chain", "tree"])
def spec_options(request) -> dict:
    """The n-gram proposer's options: chains, or token trees of up to 4 branches and 8
    nodes (their branches' rows, ``StepBatches.verify``, and their paths' KV, moved where
    a path leaves the main chain: ``SpeculativeDecode._keep_paths``)."""
    return SPEC if request.param == "chain" else TREE


def repeating_prompt(seed: int) -> list[int]:
    """A random lead-in, then a random span of 3-12 tokens two or three times (the last
    copy possibly cut): a prompt whose continuation n-grams can guess."""
    rng = random.Random(seed)
    span = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 12))]
    lead = [rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 10))]
    return lead + span * rng.randint(2, 3) + span[: rng.randint(0, len(span))]


@functools.lru_cache(maxsize=4)
def workload(count: int, seed: int) -> tuple[list[list[int]], list[dict]]:
    """``count`` repeating prompts with greedy budgets of 1-40 tokens."""
    rng = random.Random(seed)
    prompts = [repeating_prompt(seed * 10_000 + i) for i in range(count)]
    return prompts, [greedy(rng.randint(1, 40)) for _ in range(count)]


def counters(scheduler) -> dict[str, int]:
    stats = scheduler.server_info()["stats"]
    return {name: stats[name] for name in COUNTERS}


def since(scheduler, before: dict[str, int]) -> dict[str, int]:
    now = counters(scheduler)
    return {name: now[name] - before[name] for name in COUNTERS}


def assert_drafts_accepted_and_rejected(delta: dict[str, int]) -> None:
    """Drafts were verified, some of their tokens accepted and some rejected."""
    assert delta["spec_verify_steps"] > 0, delta
    assert 0 < delta["spec_accepted_tokens"] < delta["spec_draft_tokens"], delta


def fresh(scheduler):
    """``scheduler`` with an empty prefix cache: its tree drafts come from this test only."""
    assert scheduler.flush_cache()
    return scheduler


def assert_kv_accounted(scheduler) -> None:
    """Between steps: every running request holds KV for all its tokens but the last and
    nothing more (rejected draft slots went back), and free + cached + held == pool."""
    state, memory = scheduler.state, scheduler.memory
    holders = list(state.running) + ([state.chunked] if state.chunked is not None else [])
    for req in state.running:
        assert req.kv_len == req.seq_len - 1, (req.rid, req.kv_len, req.seq_len)
    held = sum(pages_for(r.kv_len, memory.page_size) - len(r.prefix_indices)
               for r in holders)
    assert (memory.allocator.available_size() + memory.tree_cache.total_size() + held
            == memory.allocator.size)


def run(scheduler, prompts, params, check_kv: bool = False, **fields) -> list:
    """The requests run as one batch (added together); their finished ``Req``s."""
    reqs = [scheduler_req(scheduler, p, s, **fields) for p, s in zip(prompts, params)]
    if not check_kv:
        run_to_completion(scheduler, reqs, max_steps=20_000)
        return reqs
    for req in reqs:
        scheduler.add_request(req)
    for _ in range(20_000):
        if all(req.finished for req in reqs):
            return reqs
        scheduler.step()
        assert_kv_accounted(scheduler)
    raise AssertionError("requests still unfinished")


def run_alone(scheduler, prompts, params, **fields) -> list:
    """Each request run by itself, one after the other."""
    return [run(scheduler, [p], [s], **fields)[0] for p, s in zip(prompts, params)]


def outputs(reqs) -> list[tuple[list[int], dict | None]]:
    return [(req.output_ids, req.finish_reason) for req in reqs]


# Greedy: the outputs of plain decoding -------------------------------------------------------


def test_greedy_requests_alone_give_the_tokens_of_plain_decoding(scheduler_for, spec_options):
    prompts, params = workload(NUM_PROMPTS, 1)
    expected = outputs(run_alone(scheduler_for(**PLAIN), prompts, params))
    spec = fresh(scheduler_for(**spec_options))
    before = counters(spec)
    assert outputs(run_alone(spec, prompts, params)) == expected
    assert_drafts_accepted_and_rejected(since(spec, before))
    assert spec.server_info()["avg_spec_accept_length"] > 1.0


def test_greedy_requests_in_one_batch_give_the_tokens_of_plain_decoding(
        scheduler_for, spec_options):
    prompts, params = workload(NUM_PROMPTS, 2)
    expected = outputs(run(scheduler_for(**PLAIN), prompts, params))
    spec = fresh(scheduler_for(**spec_options))
    before = counters(spec)
    assert outputs(run(spec, prompts, params, check_kv=True)) == expected
    assert_drafts_accepted_and_rejected(since(spec, before))


@pytest.mark.slow
@pytest.mark.parametrize(("architecture", "kv", "tied"), [
    ("Qwen2ForCausalLM", "gqa", False), ("Qwen3ForCausalLM", "gqa", False),
    ("MistralForCausalLM", "mqa", False), ("LlamaForCausalLM", "mha", True)])
def test_greedy_outputs_of_other_tiny_models_equal_plain_decoding(
        scheduler_for, spec_options, architecture, kv, tied):
    prompts, params = workload(NUM_PROMPTS, 18)
    model = (architecture, kv, tied)
    plain = scheduler_for(*model, **PLAIN)
    expected = outputs(run_alone(plain, prompts, params))
    assert outputs(run(plain, prompts, params)) == expected
    spec = fresh(scheduler_for(*model, **spec_options))
    before = counters(spec)
    assert outputs(run_alone(spec, prompts, params)) == expected
    fresh(spec)
    assert outputs(run(spec, prompts, params, check_kv=True)) == expected
    assert_drafts_accepted_and_rejected(since(spec, before))


def test_stop_tokens_stop_strings_eos_and_budgets_end_requests_as_without_drafts(
        scheduler_for, spec_options):
    """Stops chosen from the plain outputs themselves, so that they fire in the middle of
    what a draft would have covered."""
    prompts, params = workload(60, 3)
    plain = scheduler_for(**PLAIN)
    free_run = run(plain, prompts, [greedy(32) for _ in prompts])
    tokenizer = plain.sampling_step.tokenizer
    rng = random.Random(3)
    stopped = []
    for i, req in enumerate(free_run):
        tokens = req.output_ids
        kind = i % 4
        if kind == 0:
            stopped.append(greedy(32, stop_token_ids=[tokens[rng.randrange(2, 32)]]))
        elif kind == 1:
            text = tokenizer.decode(tokens[4:12])
            start = rng.randrange(0, max(1, len(text) - 2))
            stopped.append(greedy(32, stop=[text[start : start + 2] or "e"]))
        elif kind == 2:
            stopped.append(greedy(rng.randint(1, 9)))  # odd budgets: ends inside a draft
        else:
            stopped.append(greedy(32, ignore_eos=False, stop_token_ids=[tokens[9]]))
    expected = outputs(run_alone(plain, prompts, stopped))
    assert sum(reason["type"] == "stop" for _, reason in expected) >= 30
    spec = fresh(scheduler_for(**spec_options))
    before = counters(spec)
    assert outputs(run_alone(spec, prompts, stopped)) == expected
    assert outputs(run(spec, prompts, stopped, check_kv=True)) == expected
    assert_drafts_accepted_and_rejected(since(spec, before))


def test_output_logprobs_equal_plain_decoding_and_one_per_token(scheduler_for, spec_options):
    prompts, params = workload(40, 4)
    fields = {"return_logprob": True, "top_logprobs_num": 3}
    expected = run(scheduler_for(**PLAIN), prompts, params, **fields)
    spec = fresh(scheduler_for(**spec_options))
    before = counters(spec)
    got = run(spec, prompts, params, **fields)
    assert_drafts_accepted_and_rejected(since(spec, before))
    for ours, theirs in zip(got, expected):
        assert ours.output_ids == theirs.output_ids
        assert len(ours.output_token_logprobs) == len(ours.output_ids)
        assert [e[1] for e in ours.output_token_logprobs] == ours.output_ids
        torch.testing.assert_close(torch.tensor([e[0] for e in ours.output_token_logprobs]),
                                   torch.tensor([e[0] for e in theirs.output_token_logprobs]),
                                   atol=1e-5, rtol=0)
        assert len(ours.output_top_logprobs) == len(ours.output_ids)
        for top, their_top in zip(ours.output_top_logprobs, theirs.output_top_logprobs):
            assert [e[1] for e in top] == [e[1] for e in their_top]
            torch.testing.assert_close(torch.tensor([e[0] for e in top]),
                                       torch.tensor([e[0] for e in their_top]),
                                       atol=1e-5, rtol=0)


REGEX = r"((yes|no|maybe), ){2,12}(yes|no)\."
SCHEMA = ('{"type": "array", "items": {"enum": ["red", "green", "blue"]}, '
          '"minItems": 3, "maxItems": 12}')


@pytest.mark.parametrize("constraint", [{"regex": REGEX}, {"json_schema": SCHEMA}],
                         ids=["regex", "json"])
@pytest.mark.parametrize("jump_forward", [False, True], ids=["token-by-token", "jump-forward"])
def test_constrained_requests_give_the_tokens_of_plain_decoding(
        scheduler_for, spec_options, constraint, jump_forward):
    """Grammars whose outputs repeat themselves (drafts from the output): drafts are cut
    where the grammar refuses them. (With jump-forward, forced text ends a pass where it is
    appended, and the requests rarely reach a step where every one has a single token
    without KV: equality is what is checked there.)"""
    prompts, _ = workload(24, 5)
    params = [{"temperature": 0.0, "max_new_tokens": 64, **constraint} for _ in prompts]
    options = {"disable_jump_forward": not jump_forward}
    expected = outputs(run(scheduler_for(**PLAIN, **options), prompts, params))
    assert sum(reason["type"] == "stop" for _, reason in expected) >= 8
    spec = fresh(scheduler_for(**spec_options, **options))
    before = counters(spec)
    assert outputs(run(spec, prompts, params)) == expected
    if not jump_forward:
        assert since(spec, before)["spec_accepted_tokens"] > 0


def n_samples(scheduler, prompt: list[int], sampling: dict) -> list:
    """The ``n`` requests of one ``n > 1`` request, as the Engine sends them."""
    params = SamplingParams.from_dict(sampling)
    rid, leaders, reqs = uuid.uuid4().hex, {}, []
    for j in range(params.n):
        message = wire.GenerateReq(f"{rid}-{j}", list(prompt), params,
                                   prefill_leader=f"{rid}-0" if j else None)
        reqs.append(make_req(message, scheduler.sampling_step.tokenizer, leaders))
        leaders[reqs[-1].rid] = reqs[-1]
    return reqs


def test_the_samples_of_an_n_request_give_the_tokens_of_plain_decoding(scheduler_for, spec_options):
    prompts, _ = workload(12, 6)
    results = []
    for options in (PLAIN, spec_options):
        scheduler = fresh(scheduler_for(**options))
        before = counters(scheduler)
        reqs = []
        for i, prompt in enumerate(prompts):
            sampling = greedy(24, n=3) if i % 2 else sampled(100 + i, 24, n=3)
            reqs += n_samples(scheduler, prompt, sampling)
        run_to_completion(scheduler, reqs, max_steps=20_000)
        results.append(outputs(reqs))
    assert results[0] == results[1]
    assert since(scheduler, before)["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("options", [
    pytest.param({"chunked_prefill_size": 16}, id="chunked-prefill"),
    pytest.param({"page_size": 4}, id="page-size-4"),
    pytest.param({"page_size": 4, "chunked_prefill_size": 16}, id="page-size-4-chunked"),
])
def test_chunked_prefill_and_pages_give_the_tokens_of_plain_decoding(
        scheduler_for, spec_options, options):
    prompts, params = workload(80, 7)
    expected = outputs(run(scheduler_for(**PLAIN), prompts, params))
    spec = fresh(scheduler_for(**spec_options, **options))
    before = counters(spec)
    assert outputs(run(spec, prompts, params, check_kv=True)) == expected
    assert outputs(run_alone(spec, prompts[:20], params[:20])) == expected[:20]
    assert_drafts_accepted_and_rejected(since(spec, before))


def test_overlap_scheduling_with_speculation_gives_the_tokens_of_plain_decoding(
        scheduler_for, spec_options):
    prompts, params = workload(80, 8)
    expected = outputs(run(scheduler_for(**PLAIN), prompts, params))
    spec = fresh(scheduler_for(**spec_options, disable_overlap_schedule=False))
    before = counters(spec)
    assert outputs(run(spec, prompts, params)) == expected
    assert outputs(run_alone(spec, prompts[:20], params[:20])) == expected[:20]
    assert_drafts_accepted_and_rejected(since(spec, before))


def test_overlap_still_runs_ahead_for_requests_that_never_get_a_draft(scheduler_for):
    prompts, _ = workload(6, 17)
    params = [sampled(700 + i, 48) for i in range(len(prompts))]  # n-grams never match
    expected = outputs(run_alone(scheduler_for(**PLAIN), prompts, params))
    spec = fresh(scheduler_for(**SPEC, disable_overlap_schedule=False))
    before = counters(spec)
    assert outputs(run_alone(spec, prompts, params)) == expected
    delta = since(spec, before)
    assert delta["spec_drafted_requests"] == 0, delta
    assert delta["overlapped_steps"] > 0, delta


def test_requests_retracted_while_speculating_give_the_tokens_of_plain_decoding(
        scheduler_for, spec_options):
    rng = random.Random(9)
    prompts = [repeating_prompt(90_000 + i) for i in range(150)]
    params = [greedy(rng.randint(1, 48)) for _ in prompts]
    expected = outputs(run(scheduler_for(**PLAIN), prompts, params))
    spec = fresh(scheduler_for(**spec_options, **SMALL_POOL))
    before = counters(spec)
    assert outputs(run(spec, prompts, params, check_kv=True)) == expected
    delta = since(spec, before)
    assert delta["retractions"] > 0, delta
    assert_drafts_accepted_and_rejected(delta)


def test_no_step_speculates_above_the_disabling_batch_size(scheduler_for):
    prompts, _ = workload(6, 10)
    params = [greedy(20) for _ in prompts]  # one budget: the batch stays whole to the end
    expected = outputs(run(scheduler_for(**PLAIN), prompts, params))
    spec = fresh(scheduler_for(**{**SPEC, "speculative_disable_by_batch_size": 1}))
    before = counters(spec)
    assert outputs(run(spec, prompts, params)) == expected
    assert since(spec, before)["spec_verify_steps"] == 0
    fresh(spec)
    assert outputs(run_alone(spec, prompts, params)) == expected  # one at a time: it does
    assert_drafts_accepted_and_rejected(since(spec, before))


@pytest.mark.parametrize("tree", [True, False])
def test_a_repeated_request_drafts_from_the_tree_its_first_run_left(scheduler_for, tree):
    rng = random.Random(11)
    prompt = [rng.randrange(3, VOCAB) for _ in range(20)]  # no repeats: n-grams rarely fire
    params = [greedy(40)]
    expected = outputs(run(scheduler_for(**PLAIN), [prompt], params))
    spec = fresh(scheduler_for(**SPEC, speculative_ngram_disable_radix_tree=not tree))
    lengths = []
    for _ in range(2):
        before = counters(spec)
        assert outputs(run(spec, [prompt], params)) == expected
        delta = since(spec, before)
        lengths.append(1 + delta["spec_accepted_tokens"] / max(delta["spec_drafted_requests"], 1))
    if tree:  # the second run's drafts are the first run's tokens: all accepted but the end
        assert lengths[1] >= 4.0 > lengths[0], lengths
    else:
        assert lengths[1] == lengths[0], lengths


DRAFT_CONFIGS = {
    "page-1": {},
    "page-4-chunked": {"page_size": 4, "chunked_prefill_size": 16},
    "retraction": SMALL_POOL,
    "overlap": {"disable_overlap_schedule": False},
}


@pytest.mark.parametrize("config", list(DRAFT_CONFIGS))
@pytest.mark.parametrize("draft_seed", [None, 1], ids=["self-draft", "random-draft"])
def test_draft_model_speculation_gives_the_tokens_of_plain_decoding(scheduler_for,
                                                                    tiny_model_dir,
                                                                    draft_seed, config):
    """STANDALONE: a draft model that agrees with the target (itself) or almost never (another
    random model of its vocabulary), under pages, chunks, retraction and overlap; greedy
    requests with stops and seeded ones with every setting, in one batch."""
    draft = tiny_model_dir() if draft_seed is None else tiny_model_dir(seed=draft_seed)
    prompts, params = workload(48, 20)
    rng = random.Random(20)
    params = [dict(p) for p in params]
    for i in range(0, 48, 4):
        params[i + 1] = {**params[i + 1], "stop_token_ids": [rng.randrange(3, VOCAB)]}
        params[i + 2] = sampled(2000 + i, 24, **SAMPLED[(i // 4) % len(SAMPLED)])
    expected = outputs(run_alone(scheduler_for(**PLAIN), prompts, params))
    options = {**BASE, "speculative_algorithm": "STANDALONE",
               "speculative_draft_model_path": str(draft), "speculative_num_steps": 3,
               "speculative_disable_by_batch_size": 512, **DRAFT_CONFIGS[config]}
    spec = fresh(scheduler_for(**options))
    before = counters(spec)
    check_kv = config != "overlap"
    assert outputs(run(spec, prompts, params, check_kv=check_kv)) == expected
    delta = since(spec, before)
    assert delta["spec_verify_steps"] > 0 and delta["spec_draft_tokens"] > 0, delta
    if draft_seed is None:
        assert delta["spec_accepted_tokens"] > 0.5 * delta["spec_draft_tokens"], delta
    else:
        assert delta["spec_accepted_tokens"] < 0.5 * delta["spec_draft_tokens"], delta
    if config == "retraction":
        assert delta["retractions"] > 0, delta


# Sampling ------------------------------------------------------------------------------------


SAMPLED = [  # cool enough that drafts are often the tokens drawn
    {"temperature": 0.3},
    {"temperature": 0.5, "top_k": 20, "top_p": 0.9},
    {"temperature": 0.4, "min_p": 0.05},
    {"temperature": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2},
]


def seeded_workload() -> tuple[list[list[int]], list[dict]]:
    """Each prompt twice, with two seeds: the second sample drafts from the first's tokens
    in the tree (some accepted, where the two agree)."""
    prompts, _ = workload(30, 12)
    params = [sampled(seed + i, 32, **SAMPLED[i % len(SAMPLED)])
              for seed in (1000, 5000) for i in range(len(prompts))]
    return prompts + prompts, params


def test_seeded_sampling_alone_gives_the_tokens_of_plain_decoding(scheduler_for, spec_options):
    """A seeded request draws each position from (its seed, its position): the tokens do
    not depend on how many positions one pass checks."""
    prompts, params = seeded_workload()
    expected = outputs(run_alone(scheduler_for(**PLAIN), prompts, params))
    spec = fresh(scheduler_for(**spec_options))
    before = counters(spec)
    assert outputs(run_alone(spec, prompts, params)) == expected
    assert_drafts_accepted_and_rejected(since(spec, before))


def test_seeded_sampling_in_one_batch_gives_the_tokens_of_plain_decoding(
        scheduler_for, spec_options):
    prompts, params = seeded_workload()
    half = len(prompts) // 2
    plain = scheduler_for(**PLAIN)
    expected = outputs(run(plain, prompts[:half], params[:half]))
    expected += outputs(run(plain, prompts[half:], params[half:]))
    assert outputs(run_alone(plain, prompts, params)) == expected  # seeds see no batch
    spec = fresh(scheduler_for(**spec_options))
    before = counters(spec)
    got = outputs(run(spec, prompts[:half], params[:half]))
    got += outputs(run(spec, prompts[half:], params[half:]))
    assert_drafts_accepted_and_rejected(since(spec, before))
    assert got == expected


def test_greedy_requests_with_penalties_in_one_batch_give_the_tokens_of_plain_decoding(
        scheduler_for, spec_options):
    """The batch runs twice: the second time its drafts come from the tree, the very tokens
    of the first run, which are accepted position after position."""
    prompts = workload(60, 12)[0][:8]
    params = [greedy(32, frequency_penalty=0.5) for _ in prompts]
    expected = outputs(run_alone(scheduler_for(**PLAIN), prompts, params))
    spec = fresh(scheduler_for(**spec_options))
    run(spec, prompts, params)
    before = counters(spec)
    got = outputs(run(spec, prompts, params))
    assert since(spec, before)["spec_accepted_tokens"] > 0
    assert got == expected


TOP_K = 3
SAMPLES = 3000


@torch.inference_mode()
def exact_distribution(directory, prompt: list[int], length: int) -> dict[tuple, float]:
    """P(first ``length`` output tokens) at temperature 1 with top-k ``TOP_K``, from
    transformers' logits."""
    model = reference_model(directory)
    found: dict[tuple, float] = {(): 1.0}
    for _ in range(length):
        prefixes = list(found)
        batch = torch.tensor([prompt + list(p) for p in prefixes])
        logits = model(batch).logits[:, -1].float()
        top = logits.topk(TOP_K, dim=-1)
        probs = torch.softmax(top.values, dim=-1)
        found = {p + (int(t),): found[p] * float(q)
                 for p, row_t, row_q in zip(prefixes, top.indices, probs)
                 for t, q in zip(row_t, row_q)}
    return found


def chi_square_p_value(statistic: float, degrees: int) -> float:
    """P(X >= statistic) for X chi-square with ``degrees`` degrees of freedom: the upper
    regularized incomplete gamma function Q(degrees / 2, statistic / 2)."""
    return float(torch.special.gammaincc(torch.tensor(degrees / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def test_the_chi_square_p_value_matches_known_quantiles():
    # The 95th and 99.9th percentiles of chi-square with 1, 10 and 26 degrees of freedom.
    for statistic, degrees, upper in [(3.841, 1, 0.05), (18.307, 10, 0.05),
                                      (54.052, 26, 0.001)]:
        assert chi_square_p_value(statistic, degrees) == pytest.approx(upper, rel=1e-3)


@pytest.mark.parametrize("proposer", ["ngram", "ngram-tree", "self-draft"])
def test_unseeded_sampling_keeps_the_target_distribution(scheduler_for, tiny_model_dir,
                                                         proposer):
    """Chi-square of the first three output tokens of many unseeded samples against their
    exact probabilities: the drafts (n-grams: from the tree the earlier samples filled and
    the prompt's repeats; or the target's own greedy tokens, from itself as draft model)
    change how many positions a pass checks, never what comes out."""
    prompt = repeating_prompt(13)
    length = 3
    exact = exact_distribution(tiny_model_dir(), prompt, length)
    options = {**(TREE if proposer == "ngram-tree" else SPEC),
               "speculative_disable_by_batch_size": 64}
    if proposer == "self-draft":  # each draft the target's own most likely token
        options |= {"speculative_algorithm": "STANDALONE", "speculative_num_steps": 2,
                    "speculative_draft_model_path": str(tiny_model_dir())}
    spec = fresh(scheduler_for(**options))
    before = counters(spec)
    params = {"temperature": 1.0, "top_k": TOP_K, "max_new_tokens": length,
              "ignore_eos": True}
    seen: dict[tuple, int] = {}
    for _ in range(SAMPLES // 60):
        for req in run(spec, [prompt] * 60, [params] * 60):
            key = tuple(req.output_ids)
            seen[key] = seen.get(key, 0) + 1
    assert_drafts_accepted_and_rejected(since(spec, before))
    assert set(seen) <= set(exact)
    # Cells with an expected count under 5 are pooled into one.
    total = sum(seen.values())
    stat, cells, rest_seen, rest_expected = 0.0, 0, 0, 0.0
    for key, p in exact.items():
        expected = p * total
        if expected < 5:
            rest_seen += seen.get(key, 0)
            rest_expected += expected
            continue
        stat += (seen.get(key, 0) - expected) ** 2 / expected
        cells += 1
    if rest_expected > 0:
        stat += (rest_seen - rest_expected) ** 2 / rest_expected
        cells += 1
    assert cells >= 8
    assert chi_square_p_value(stat, cells - 1) > 1e-4, (stat, cells)


# Token trees -----------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_path_down_a_side_branch_keeps_its_kv_and_the_tokens_of_plain_decoding(
        scheduler_for, page_size):
    """The tree holds a prompt's true continuation and, used later, a wrong one that
    agrees with it for two tokens: the draft's main chain is the wrong one, and the
    request's path leaves it for the other branch, whose KV then moves to the positions
    the request keeps (``_keep_paths``): the tokens after it, computed over that KV, are
    still those of plain decoding."""
    rng = random.Random(21)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(21)] for _ in range(6)]
    params = [greedy(24) for _ in prompts]
    expected = outputs(run(scheduler_for(**PLAIN), prompts, params))
    spec = fresh(scheduler_for(**TREE, page_size=page_size))
    assert outputs(run(spec, prompts, params)) == expected  # caches each true continuation
    wrong = []
    for prompt, (tokens, _) in zip(prompts, expected):
        swapped = (tokens[2] + 1 - 3) % (VOCAB - 3) + 3  # a token other than tokens[2]
        wrong.append(prompt + tokens[:2] + [swapped] + tokens[3:12])
    run(spec, wrong, [greedy(1) for _ in wrong])  # now the later-used branch
    before = counters(spec)
    assert outputs(run(spec, prompts, params, check_kv=True)) == expected
    delta = since(spec, before)
    assert delta["spec_accepted_branch_tokens"] >= len(prompts), delta


# KV ------------------------------------------------------------------------------------------


def test_rejected_draft_slots_are_freed_at_once_and_the_pool_ends_idle(scheduler_for, spec_options):
    """Between every two steps no running request holds a slot beyond its tokens (checked
    by ``run``), and afterwards free + cached == pool with nothing locked."""
    prompts, params = workload(40, 14)
    spec = fresh(scheduler_for(**spec_options, page_size=4))
    before = counters(spec)
    run(spec, prompts, params, check_kv=True)
    for prompt, param in zip(prompts[:10], params[:10]):
        run(spec, [prompt], [param], check_kv=True)
    delta = since(spec, before)
    assert_drafts_accepted_and_rejected(delta)
    info = spec.server_info()
    assert info["free_kv_tokens"] + info["cache_tokens"] == info["max_total_tokens"]
    assert info["cache_protected_tokens"] == 0


def flat(results: list) -> list[dict]:
    """The Engine's outputs, an ``n > 1`` request's (a list) spread out."""
    return [one for result in results
            for one in (result if isinstance(result, list) else [result])]


class Injected(RuntimeError):
    """The fault a test puts into a verify step."""


class FailingAttribute:
    """``real`` with its method ``name`` raising ``Injected`` at its ``call``-th call
    (1-based), for one component's view of a shared object."""

    def __init__(self, real, name: str, call: int):
        self.real, self.name, self.call, self.calls = real, name, call, 0

    def __getattr__(self, attribute: str):
        found = getattr(self.real, attribute)
        if attribute != self.name:
            return found

        def failing(*args, **kwargs):
            self.calls += 1
            if self.calls == self.call:
                raise Injected(f"injected into {self.name} call {self.call}")
            return found(*args, **kwargs)
        return failing


FAULTS = {  # where a verify step fails: (algorithm, the speculation's component, method, call)
    "forward": ("NGRAM", "runner", "forward", 2),  # slots allocated, nothing computed
    "logits": ("NGRAM", "runner", "compute_logits", 2),  # every draft token's KV written
    "append": ("NGRAM", "sampling_step", "append_tokens", 3),  # some tokens appended
    "tree-logits": ("TREE", "runner", "compute_logits", 2),  # the branches' rows taken
    "tree-append": ("TREE", "sampling_step", "append_tokens", 3),
    "draft-pass": ("STANDALONE", "proposer.runner", "forward", 3),  # the draft model's
    "draft-verify": ("STANDALONE", "runner", "forward", 2),
}


def step_until_injected_failure(spec, reqs, check_kv: bool = False) -> None:
    """Adds ``reqs`` and steps ``spec`` until the injected failure is raised (checking the
    KV accounts between steps where ``check_kv``)."""
    for req in reqs:
        spec.add_request(req)
    with pytest.raises(Injected):
        for _ in range(1000):
            spec.step()
            if check_kv:
                assert_kv_accounted(spec)


def abort_after_failure(spec) -> None:
    """Aborts every request as the scheduler's process does after a failed step."""
    for req in spec.requests():
        spec.abort(req, "internal error", cache=False)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_failed_verify_step_leaks_no_slot_and_the_scheduler_serves_on(
        scheduler_for, tiny_model_dir, page_size, fault):
    """As the scheduler's process handles a failed step: every request aborted. Their KV,
    draft slots included, goes back; the same requests then run as without speculation."""
    algorithm, component, method, call = FAULTS[fault]
    prompts, params = workload(8, 19)
    expected = outputs(run(scheduler_for(**PLAIN), prompts, params))
    options = {**SPEC, "speculative_algorithm": algorithm, "page_size": page_size}
    if algorithm == "TREE":
        options |= {**TREE, "speculative_algorithm": "NGRAM"}
    if algorithm == "STANDALONE":
        options |= {"speculative_draft_model_path": str(tiny_model_dir()),
                    "speculative_num_steps": 3}
    spec = fresh(scheduler_for(**options))
    *path, name = ["speculation", *component.split(".")]
    owner = functools.reduce(getattr, path, spec)
    real = getattr(owner, name)
    setattr(owner, name, FailingAttribute(real, method, call))
    reqs = [scheduler_req(spec, p, s) for p, s in zip(prompts, params)]
    try:
        step_until_injected_failure(spec, reqs, check_kv=True)
    finally:
        setattr(owner, name, real)
    abort_after_failure(spec)
    assert all(req.finished for req in reqs)
    rows = spec.memory.req_to_token_pool
    assert rows.available_size() == rows.size  # a tree's branch rows went back too
    info = spec.server_info()
    assert info["free_kv_tokens"] + info["cache_tokens"] == info["max_total_tokens"]
    assert info["cache_protected_tokens"] == 0
    before = counters(spec)
    assert outputs(run(spec, prompts, params, check_kv=True)) == expected
    assert since(spec, before)["spec_accepted_tokens"] > 0


def test_a_verify_pass_that_failed_before_computing_caches_no_unwritten_kv(scheduler_for):
    prompts, _ = workload(4, 19)
    spec = fresh(scheduler_for(**SPEC))
    speculation = spec.speculation
    real = speculation.runner
    speculation.runner = FailingAttribute(real, "forward", 2)
    reqs = [scheduler_req(spec, p, greedy(30)) for p in prompts]
    try:
        step_until_injected_failure(spec, reqs)
    finally:
        speculation.runner = real
    abort_after_failure(spec)
    follow = [req.all_ids() + [5, 6] for req in reqs]  # the next turn of each conversation
    params = [greedy(10) for _ in follow]
    expected = outputs(run(fresh(scheduler_for(**PLAIN)), follow, params))
    assert outputs(run(spec, follow, params)) == expected


# Through the Engine --------------------------------------------------------------------------


@pytest.mark.slow  # two engines (6 s); the scheduler-level tests above stay
def test_the_engine_with_ngram_speculation_returns_what_it_returns_without(engine_for):
    """Native outputs (ids, finish reasons, logprobs) for greedy requests of every kind
    sent alone and together, n > 1 included, and seeded ones sent alone; the server info
    reports the acceptance."""
    prompts, _ = workload(24, 15)
    params = []
    for i, prompt in enumerate(prompts):
        kind = i % 4
        params.append(greedy(24) if kind == 0 else greedy(24, stop=["e", " t"]) if kind == 1
                      else greedy(24, n=2) if kind == 2
                      else greedy(24, ignore_eos=False, stop_token_ids=[prompt[-1]]))
    seeded = [sampled(500 + i, 24, temperature=0.4) for i in range(4)]  # alone: one row
    fields = {"return_logprob": True, "top_logprobs_num": 3}
    results = []
    for options in ({}, {"speculative_algorithm": "NGRAM",
                         "speculative_disable_by_batch_size": 64}):
        engine = engine_for(**options)
        engine.flush_cache()
        alone = [engine.generate(input_ids=p, sampling_params=s, **fields)
                 for p, s in zip(prompts + prompts[:4], params + seeded)]
        together = engine.generate(input_ids=prompts, sampling_params=params, **fields)
        results.append((alone, together, engine.get_server_info()))
        assert_engine_idle(engine)
    (plain_alone, plain_together, _), (alone, together, info) = results
    for ours, theirs in zip(flat(alone) + flat(together), flat(plain_alone) + flat(plain_together),
                            strict=True):
        assert ours["output_ids"] == theirs["output_ids"]
        assert ours["meta_info"]["finish_reason"] == theirs["meta_info"]["finish_reason"]
        got = [e[0] for e in ours["meta_info"]["output_token_logprobs"]]
        want = [e[0] for e in theirs["meta_info"]["output_token_logprobs"]]
        assert len(got) == len(ours["output_ids"])
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)
    assert info["speculative_algorithm"] == "NGRAM"
    assert info["avg_spec_accept_length"] > 1.0
    stats = info["stats"]
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]


# The default model ---------------------------------------------------------------------------

QUOTED = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a "
          "lantern, a notebook and a flask of tea. From the gallery he could see the fishing "
          "boats returning to the harbour, their sails folded and their decks piled with nets.")
DEFAULT_MODEL_PROMPTS = [
    f"Copy the following text exactly.\n\nText: {QUOTED}\n\nCopy: ",
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]


@pytest.mark.slow
@pytest.mark.default_model
def test_the_default_model_quotes_with_drafts_accepted_and_the_tokens_of_plain_decoding():
    path = str(default_model_path())
    schedulers = [build_scheduler(ServerArgs(path, dtype="float32", max_total_tokens=4096,
                                             **options), path) for options in (PLAIN, SPEC)]
    try:
        plain, spec = schedulers
        tokenizer = plain.sampling_step.tokenizer
        prompts = [tokenizer.encode(text) for text in DEFAULT_MODEL_PROMPTS]
        params = [greedy(64) for _ in prompts]
        expected = outputs(run_alone(plain, prompts, params))
        before = counters(spec)
        assert outputs(run(spec, prompts[:1], params[:1])) == expected[:1]
        quoting = since(spec, before)
        # A quote: most drafts are the prompt's own tokens, accepted.
        assert 1 + quoting["spec_accepted_tokens"] / quoting["spec_drafted_requests"] > 1.5
        assert outputs(run_alone(spec, prompts, params)) == expected
        assert outputs(run(spec, prompts, params)) == expected
        for scheduler in schedulers:
            info = scheduler.server_info()
            assert info["free_kv_tokens"] + info["cache_tokens"] == info["max_total_tokens"]
            assert info["cache_protected_tokens"] == 0
    finally:
        for scheduler in schedulers:
            scheduler.shutdown()
