"""Beam search in the scheduler, run in-process: however the scheduler runs the beams (pages of
4 tokens with copy on write, a prompt prefilled in chunks, with or without overlap, beside
ordinary requests, retracted and started over) they are transformers' hypotheses, and the
ordinary requests beside them keep their own tokens. And the KV a search holds: the prompt
once plus each beam's own tokens, step by step, all of it given back at the end."""

from __future__ import annotations

import functools

import pytest
from beam_reference import beam, check_beams, frequent_stop_ids, reference_beams
from runtime_checks import assert_pool_idle, beam_reqs, run_to_completion, scheduler_req
from workloads import greedy, random_ids

BASE = {"num_threads": 1}
NEW_TOKENS = 16
SEARCHES = [(2, 1.0, False, False), (4, 2.0, True, True), (8, 0.0, "never", False),
            (8, -0.5, False, True)]
"""(width, length_penalty, early_stopping, with stop tokens) of the workload's searches."""
BOLD = dict(init_new_token_ratio=0.01, min_new_token_ratio=0.01, new_token_ratio_decay=0.5)


def outputs(reqs) -> list[dict]:
    """Finished members as the Engine reports them."""
    return [{"output_ids": r.output_ids,
             "meta_info": {"finish_reason": r.finish_reason,
                           "cumulative_logprob": r.cumulative_logprob,
                           "beam_score": r.beam_score}} for r in reqs]


@functools.lru_cache(maxsize=4)
def workload(directory, eos: int, prompt_len: int) -> list[tuple]:
    """(prompt, sampling params, transformers' hypotheses, EOS ids) per search of
    ``SEARCHES``, on prompts of about ``prompt_len`` tokens."""
    searches = []
    for i, (width, lp, es, with_stops) in enumerate(SEARCHES):
        ids = random_ids(900 + i, prompt_len + 3 * i)
        stops = frequent_stop_ids(directory, ids, width, NEW_TOKENS, lp, es, eos) \
            if with_stops else []
        eos_ids = stops + [eos]
        extra = {"stop_token_ids": stops} if stops else {}
        expected = reference_beams(directory, ids, width, NEW_TOKENS, lp, es, eos_ids)
        searches.append((ids, beam(width, NEW_TOKENS, lp, es, **extra), expected, eos_ids))
    return searches


def ordinary_requests(count: int, seed: int, low: int, high: int) -> list[tuple]:
    return [(random_ids(seed + i, low + (high - low) * i // max(count - 1, 1)),
             greedy(low // 2 + 5 * i)) for i in range(count)]


def run_alone(scheduler, requests) -> list[list[int]]:
    """Each ordinary request's tokens when it runs by itself."""
    outs = []
    for ids, params in requests:
        req = scheduler_req(scheduler, ids, params)
        run_to_completion(scheduler, [req])
        outs.append(req.output_ids)
    return outs


def run_together(scheduler, searches, requests) -> tuple[list[list], list]:
    """Every search and ordinary request added at once, run until all finish."""
    groups = [beam_reqs(scheduler, ids, params) for ids, params, _, _ in searches]
    plain = [scheduler_req(scheduler, ids, params) for ids, params in requests]
    run_to_completion(scheduler, [r for g in groups for r in g] + plain, max_steps=20_000)
    return groups, plain


def check_searches(groups, searches) -> int:
    stops = 0
    for group, (_, params, expected, eos_ids) in zip(groups, searches):
        stops += check_beams(outputs(group), expected, params["length_penalty"], eos_ids,
                             NEW_TOKENS)
    return stops


@pytest.mark.parametrize("options", [
    {}, {"page_size": 4}, {"chunked_prefill_size": 16}, {"disable_overlap_schedule": False},
    {"page_size": 4, "chunked_prefill_size": 16, "disable_overlap_schedule": False},
], ids=["default", "page4", "chunked16", "overlap", "page4-chunked16-overlap"])
def test_beams_equal_transformers_however_the_scheduler_runs_them(
    scheduler_for, tiny_model_dir, options
):
    """Four searches (widths 2 to 8, two with stop tokens) on ~50-token prompts and three
    greedy requests, all added at once: the searches are transformers' and the greedy
    requests keep their tokens alone. Chunks of 16 split every prompt in 4 or more, and a
    50-token prompt leaves a partial page to copy when beams fork."""
    scheduler = scheduler_for(**BASE, **options)
    scheduler.flush_cache()
    directory = tiny_model_dir()
    searches = workload(directory, scheduler.sampling_step.tokenizer.eos_token_id, 50)
    requests = ordinary_requests(3, 950, 20, 60)
    alone = run_alone(scheduler_for(**BASE), requests)
    groups, plain = run_together(scheduler, searches, requests)
    assert [r.output_ids for r in plain] == alone
    assert check_searches(groups, searches) > 0, "no hypothesis ended on a stop token"
    assert_pool_idle(scheduler.server_info())


@pytest.mark.parametrize(("architecture", "kv"), [
    ("Qwen3ForCausalLM", "gqa"), ("MixtralForCausalLM", "gqa"), ("DeepseekV2ForCausalLM", "mha"),
])
def test_other_architectures_fork_pages_and_chunk_prompts_as_llama_does(
    scheduler_for, tiny_model_dir, architecture, kv
):
    """Pages of 4 copied on write (an MLA pool's latents too) and prompts in chunks of 16,
    beside greedy requests, on Qwen3, Mixtral and DeepSeek-V2: transformers' hypotheses."""
    options = {"page_size": 4, "chunked_prefill_size": 16}
    scheduler = scheduler_for(architecture, kv, **BASE, **options)
    directory = tiny_model_dir(architecture, kv)
    searches = workload(directory, scheduler.sampling_step.tokenizer.eos_token_id, 30)
    requests = ordinary_requests(2, 970, 20, 40)
    alone = run_alone(scheduler_for(architecture, kv, **BASE), requests)
    groups, plain = run_together(scheduler, searches, requests)
    assert [r.output_ids for r in plain] == alone
    check_searches(groups, searches)
    assert_pool_idle(scheduler.server_info())


def test_a_retracted_search_starts_over_and_still_equals_transformers(
    scheduler_for, tiny_model_dir
):
    """A 512-slot pool and admission that reserves almost nothing for running requests'
    output: the four searches on ~100-token prompts (about 800 slots at their peaks
    together) and two greedy requests cannot all run at once, so some are retracted, a
    search among them; it starts over and ends as if never retracted."""
    scheduler = scheduler_for(**BASE, max_total_tokens=512, **BOLD)
    scheduler.flush_cache()
    directory = tiny_model_dir()
    searches = workload(directory, scheduler.sampling_step.tokenizer.eos_token_id, 100)
    requests = ordinary_requests(2, 960, 60, 90)
    alone = run_alone(scheduler_for(**BASE), requests)
    before = scheduler.state.stats.retractions
    groups, plain = run_together(scheduler, searches, requests)
    assert scheduler.state.stats.retractions > before, "nothing was retracted: the test is void"
    assert any(r.retractions > 0 for g in groups for r in g), \
        "only ordinary requests were retracted: no search started over"
    assert [r.output_ids for r in plain] == alone
    check_searches(groups, searches)
    assert_pool_idle(scheduler.server_info())


def round_up(tokens: int, page: int) -> int:
    return -(-tokens // page) * page


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_width_8_search_over_512_tokens_holds_the_prompt_once(
    scheduler_for, tiny_model_dir, page_size
):
    """After every step, the slots held (allocated, less what the prefix cache could evict)
    are at most the prompt once plus 8 beams x the steps so far (one more for a step queued
    ahead), plus a page per beam with pages: not 8 prompts. When the search ends the pool
    is idle and the cache holds at most the prompt and the best hypothesis. The tiny model
    is run past its 512 positions (context_length 1024): RoPE needs no table, and
    transformers is the reference there too."""
    scheduler = scheduler_for(**BASE, context_length=1024, page_size=page_size)
    scheduler.flush_cache()
    memory = scheduler.memory
    prompt, width, new = 512, 8, 24
    ids = random_ids(990, prompt)
    params = beam(width, new, 1.0, "never")
    reqs = beam_reqs(scheduler, ids, params)
    for req in reqs:
        scheduler.add_request(req)
    slack = width * page_size if page_size > 1 else 0
    steps = 0
    peak_held = 0
    while not all(r.finished for r in reqs):
        scheduler.step()
        steps += 1
        assert steps < 200, "the search did not finish"
        cache = memory.tree_cache
        held = (memory.allocator.size - memory.allocator.available_size()
                - (cache.total_size() - cache.protected_size()))
        bound = round_up(prompt, page_size) + width * (steps + 1) + slack
        assert held <= bound, f"step {steps}: {held} slots held, at most {bound} expected"
        peak_held = max(peak_held, held)
    assert peak_held > prompt + width, "the beams never held KV of their own"
    info = scheduler.server_info()
    assert_pool_idle(info)
    assert info["cache_tokens"] <= round_up(prompt + new, page_size), info["cache_tokens"]
    assert info["peak_kv_tokens"] <= round_up(prompt, page_size) + width * (new + 1) + slack
    eos = [scheduler.sampling_step.tokenizer.eos_token_id]
    check_beams(outputs(reqs), reference_beams(tiny_model_dir(), ids, width, new, 1.0,
                                               "never", eos), 1.0, eos, new)
