"""The prefix cache wired into the Engine: cache hits, namespaces, eviction, flushing, and
outputs that do not depend on whether (or how) the cache served the prompt."""

from __future__ import annotations

import pytest
import torch
from workloads import random_ids

GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_cached_tokens_count_the_shared_prefix_rounded_down_to_a_page(engine_for, page_size):
    engine = engine_for(page_size=page_size)
    engine.flush_cache()
    first = random_ids(1, 50)
    out = engine.generate(input_ids=first, sampling_params=GREEDY)
    assert out["meta_info"]["cached_tokens"] == 0
    again = engine.generate(input_ids=first, sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] == (49 // page_size) * page_size
    shared = 37
    sibling = first[:shared] + random_ids(2, 20)
    out = engine.generate(input_ids=sibling, sampling_params=GREEDY)
    assert out["meta_info"]["cached_tokens"] == (shared // page_size) * page_size


def test_a_different_namespace_shares_nothing(engine_for):
    engine = engine_for()
    engine.flush_cache()
    ids = random_ids(3, 40)
    engine.generate(input_ids=ids, sampling_params=GREEDY, extra_key="tenant-a")
    other = engine.generate(input_ids=ids, sampling_params=GREEDY, extra_key="tenant-b")
    assert other["meta_info"]["cached_tokens"] == 0
    same = engine.generate(input_ids=ids, sampling_params=GREEDY, extra_key="tenant-a")
    assert same["meta_info"]["cached_tokens"] == 39


def test_disabled_cache_never_hits(engine_for):
    engine = engine_for(disable_radix_cache=True)
    ids = random_ids(4, 30)
    engine.generate(input_ids=ids, sampling_params=GREEDY)
    out = engine.generate(input_ids=ids, sampling_params=GREEDY)
    assert out["meta_info"]["cached_tokens"] == 0
    assert engine.get_server_info()["cache_tokens"] == 0


def _run_workload(engine) -> list[dict]:
    """Prompts that hit the cache whole, in the middle of a node, and not at all."""
    base = random_ids(10, 60)
    prompts = [
        base,
        base[:45] + random_ids(11, 10),  # splits base's node at 45
        base[:20] + random_ids(12, 30),  # splits again, higher up
        base + random_ids(13, 5),  # extends a cached path
        random_ids(14, 33),
    ]
    params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    outputs = [
        engine.generate(input_ids=p, sampling_params=params, return_logprob=True,
                        logprob_start_len=len(p) - 4, top_logprobs_num=2)
        for p in prompts
    ]
    # And all at once, so requests sharing prefixes run in one batch.
    outputs += engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                               logprob_start_len=10)
    return outputs


@pytest.mark.parametrize("page_size", [1, 4, pytest.param(16, marks=pytest.mark.slow)])
def test_outputs_do_not_depend_on_the_cache(engine_for, page_size):
    baseline = _run_workload(engine_for(disable_radix_cache=True))
    engine = engine_for(page_size=page_size)
    engine.flush_cache()
    cached = _run_workload(engine)
    assert sum(o["meta_info"]["cached_tokens"] for o in cached) > 0
    for ours, base in zip(cached, baseline):
        assert ours["output_ids"] == base["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            got = [entry[0] for entry in ours["meta_info"][key]]
            want = [entry[0] for entry in base["meta_info"][key]]
            assert len(got) == len(want)
            torch.testing.assert_close(
                torch.tensor(got[1:] if got and got[0] is None else got),
                torch.tensor(want[1:] if want and want[0] is None else want),
                atol=1e-5, rtol=0,
            )


def test_recently_used_prefixes_survive_eviction_and_the_oldest_go(engine_for):
    engine = engine_for(max_total_tokens=512)
    engine.flush_cache()
    prompts = [random_ids(100 + i, 60) for i in range(20)]
    params = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    for i, prompt in enumerate(prompts):
        engine.generate(input_ids=prompt, sampling_params=params)
        if i >= 1:
            # Keep prompt 0 hot: it is used again after every new prompt.
            hit = engine.generate(input_ids=prompts[0], sampling_params=params)
            assert hit["meta_info"]["cached_tokens"] == 59
        info = engine.get_server_info()
        assert info["free_kv_tokens"] + info["cache_tokens"] == info["max_total_tokens"]
    recent = engine.generate(input_ids=prompts[-1], sampling_params=params)
    assert recent["meta_info"]["cached_tokens"] == 59
    oldest = engine.generate(input_ids=prompts[1], sampling_params=params)
    assert oldest["meta_info"]["cached_tokens"] == 0


@pytest.mark.slow  # two engines of their own (8 s); the tree's lock tests stay
def test_a_running_request_keeps_its_prefix_while_others_evict(engine_for):
    small = engine_for(max_total_tokens=384)
    small.flush_cache()
    big = engine_for(disable_radix_cache=True)
    shared = random_ids(200, 40)
    prompts = [shared + random_ids(201 + i, 8) for i in range(6)]
    prompts += [random_ids(300 + i, 50) for i in range(6)]
    params = {"max_new_tokens": 20, "temperature": 0.0, "ignore_eos": True}
    ours = small.generate(input_ids=prompts, sampling_params=params)
    theirs = big.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in ours] == [o["output_ids"] for o in theirs]


def test_flush_cache_is_refused_while_a_request_runs(engine_for):
    # A request far too long to end by itself while the flush is on its way, however
    # contended the machine: it is aborted after.
    engine = engine_for(context_length=4096, max_total_tokens=8192)
    ids = random_ids(5, 30)
    params = {**GREEDY, "max_new_tokens": 4000, "ignore_eos": True}
    stream = engine.generate(input_ids=ids, sampling_params=params, stream=True, rid="long")
    next(stream)
    assert engine.flush_cache() is False
    engine.abort("long")
    *_, last = stream
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert engine.flush_cache() is True
    assert engine.get_server_info()["cache_tokens"] == 0
    out = engine.generate(input_ids=ids, sampling_params=GREEDY)
    assert out["meta_info"]["cached_tokens"] == 0
