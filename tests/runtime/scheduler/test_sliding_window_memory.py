"""Sliding-window layers over the hybrid pool, in the scheduler: a running request holds
its window's local KV and no more, cache hits cut back to a complete window, and every
result equals the plain pool's (where every layer keeps every token's KV) and
transformers'.

The model: a tiny Mistral whose two layers attend to a window of ``W`` keys. The plain pool
is forced by making ``kv_pool_layout.plain_pool_reason`` give a reason; both pools run the
same attention backend, which masks the window either way.
"""

from __future__ import annotations

import pytest
import torch
from process_settings import ProcessSettings
from runtime_checks import assert_pool_idle, beam_reqs, run_to_completion, scheduler_req
from tiny_models import reference_greedy, write_tiny_model
from workloads import greedy, random_ids, sampled

import radixlm.runtime.model_executor.kv_pool_layout as kv_pool_layout
from radixlm.kv_cache.hybrid_pool import HybridKVPool
from radixlm.runtime.scheduler.scheduler_process import build_scheduler
from radixlm.runtime.server_args import ServerArgs

W = 8


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("mistral_w8"), "MistralForCausalLM",
                            sliding_window=W)


@pytest.fixture(scope="module")
def schedulers(mistral_dir):
    """build(plain=False, **options): a scheduler over the tiny Mistral (built once per
    options), with the hybrid pool unless ``plain``."""
    built = {}

    def build(plain: bool = False, **options):
        key = (plain, tuple(sorted(options.items())))
        if key not in built:
            options = {"dtype": "float32", "max_total_tokens": 4096, "page_size": 4,
                       "max_running_requests": 8, "chunked_prefill_size": 16,
                       "disable_adaptive_timing": True, **options}
            with pytest.MonkeyPatch.context() as patch:
                if plain:
                    patch.setattr(kv_pool_layout, "plain_pool_reason",
                                  lambda *args: "the test's plain pool")
                scheduler = build_scheduler(ServerArgs(str(mistral_dir), **options),
                                            str(mistral_dir))
            assert isinstance(scheduler.runner.kv_pool, HybridKVPool) != plain
            built[key] = scheduler, ProcessSettings.now()
        scheduler, settings = built[key]
        settings.apply()
        return scheduler

    yield build
    for scheduler, _ in built.values():
        assert_pool_idle(scheduler.server_info())
        scheduler.shutdown()


def run(scheduler, prompts, params, **fields):
    reqs = [scheduler_req(scheduler, p, s, **fields) for p, s in zip(prompts, params)]
    run_to_completion(scheduler, reqs)
    return reqs


def output_logprobs(req) -> torch.Tensor:
    return torch.tensor([entry[0] for entry in req.output_token_logprobs])


def assert_same_outputs(got, want) -> None:
    for ours, theirs in zip(got, want):
        assert ours.output_ids == theirs.output_ids
        if ours.output_token_logprobs:
            torch.testing.assert_close(output_logprobs(ours), output_logprobs(theirs),
                                       atol=1e-5, rtol=0)


def test_the_local_pool_holds_a_window_and_a_page_per_request_over_a_long_generation(
        schedulers):
    page = 4
    hybrid = schedulers(disable_radix_cache=True)
    prompts = [random_ids(seed, 40) for seed in range(3)]
    reqs = [scheduler_req(hybrid, p, greedy(80)) for p in prompts]
    for req in reqs:
        hybrid.add_request(req)
    memory, state = hybrid.memory, hybrid.state
    for _ in range(1000):
        if all(req.finished for req in reqs):
            break
        hybrid.step()
        holding = len(state.running) + (state.chunked is not None)
        used = memory.local_slots_in_use()
        assert used <= holding * (W + page), (used, holding)
    assert all(req.finished for req in reqs)
    assert memory.local_slots_in_use() == 0
    assert hybrid.windows.freed_local_slots > 3 * 80
    plain = run(schedulers(plain=True, disable_radix_cache=True), prompts,
                [greedy(80)] * 3)
    assert_same_outputs(reqs, plain)


def test_overlapped_decode_steps_free_the_window_and_give_the_plain_pools_results(schedulers):
    """With a decode step in flight its requests' ``kv_len`` already counts the token it
    computes: what is freed is still out of that token's window."""
    page = 4
    hybrid = schedulers(disable_overlap_schedule=False, disable_radix_cache=True)
    prompts = [random_ids(70 + seed, 30) for seed in range(3)]
    reqs = [scheduler_req(hybrid, p, greedy(50)) for p in prompts]
    for req in reqs:
        hybrid.add_request(req)
    while not all(req.finished for req in reqs):
        hybrid.step()
        holding = len(hybrid.state.running) + (hybrid.state.chunked is not None)
        assert hybrid.memory.local_slots_in_use() <= holding * (W + page)
    assert hybrid.state.stats.overlapped_steps > 0
    info = hybrid.server_info()["sliding_window_kv"]
    assert info["window"] == W and info["free_local_kv_tokens"] == info["local_kv_tokens"]
    want = run(schedulers(plain=True, disable_radix_cache=True), prompts, [greedy(50)] * 3)
    assert_same_outputs(reqs, want)


def test_with_the_cache_a_request_holds_its_window_and_the_tree_the_rest(schedulers):
    page = 4
    hybrid = schedulers()
    reqs = [scheduler_req(hybrid, random_ids(10 + seed, 40), greedy(60)) for seed in range(2)]
    for req in reqs:
        hybrid.add_request(req)
    memory = hybrid.memory
    while not all(req.finished for req in reqs):
        hybrid.step()
        state = hybrid.state
        holding = state.running + ([state.chunked] if state.chunked is not None else [])
        assert memory.own_local_slots(holding) <= len(holding) * (W + page)
        # Beside its own, each keeps the tree's pages of the W - 1 tokens before its prefix.
        kept = memory.local_slots_in_use() - memory.tree_cache.local_evictable_size()
        assert kept <= len(holding) * 2 * (W + page)
    hybrid.memory.tree_cache.evict_local(10**6)
    assert memory.local_slots_in_use() == 0


def test_cache_hits_past_the_window_give_the_cold_results(schedulers):
    """A finished request's sequence is cached with local KV only for its last window (and
    its prompt, which the tree holds): a continuation of all of it hits it whole; one that
    branches off in the dropped middle is cut back to the prompt."""
    hybrid, cold = schedulers(), schedulers(plain=True, disable_radix_cache=True)
    hybrid.flush_cache()
    prompt = random_ids(21, 48)
    first = run(hybrid, [prompt], [greedy(40)])[0]
    sequence = prompt + first.output_ids
    whole = sequence[:88] + random_ids(22, 10)
    branch = sequence[:70] + random_ids(23, 10)
    params = greedy(12)
    hits = run(hybrid, [whole], [params], return_logprob=True)
    hits += run(hybrid, [branch], [params], return_logprob=True)
    assert [r.cached_tokens for r in hits] == [84, 48]  # (84: all the first one's KV)
    want = run(cold, [whole, branch], [params, params], return_logprob=True)
    assert_same_outputs(hits, want)


@pytest.mark.parametrize("page", [1, 4, 16])
def test_chunked_prompts_shared_by_several_samples_give_the_plain_pools_results(
        schedulers, page):
    prompt = random_ids(30 + page, 45)
    prompts = [prompt, prompt, prompt + random_ids(3, 7)]
    params = [sampled(1, 30), sampled(2, 30), greedy(30)]
    got = run(schedulers(page_size=page), prompts, params, return_logprob=True)
    want = run(schedulers(plain=True, page_size=page), prompts, params, return_logprob=True)
    assert_same_outputs(got, want)
    assert got[1].cached_tokens > 0 or got[0].cached_tokens > 0


def test_greedy_tokens_equal_transformers_mistral_with_a_sliding_window(schedulers,
                                                                       mistral_dir):
    prompt = random_ids(40, 30)
    got = run(schedulers(), [prompt], [greedy(40)])[0]
    assert got.output_ids == reference_greedy(mistral_dir, prompt, 40)


@pytest.mark.parametrize("page", [1, 4, 16])
def test_beam_search_over_the_hybrid_pool_gives_the_plain_pools_beams(schedulers, page):
    """Beams share pages (copied on write, through the map in sliding layers) and free the
    local KV of shared pages out of every member's window at once."""
    prompt = random_ids(50, 30)
    params = {"use_beam_search": True, "n": 3, "max_new_tokens": 30, "ignore_eos": True}
    results = []
    for plain in (False, True):
        scheduler = schedulers(plain=plain, page_size=page)
        reqs = beam_reqs(scheduler, prompt, params)
        freed = 0 if plain else scheduler.windows.freed_local_slots
        run_to_completion(scheduler, reqs)
        results.append([r.output_ids for r in reqs])
        if not plain:
            assert scheduler.windows.freed_local_slots > freed  # (shared slots count once)
    assert results[0] == results[1]


def test_retracted_requests_over_the_hybrid_pool_give_the_plain_pools_results(schedulers):
    prompts = [random_ids(60 + seed, 30) for seed in range(6)]
    params = [greedy(60)] * 6
    hybrid = schedulers(max_total_tokens=256, page_size=4)
    got = run(hybrid, prompts, params)
    assert hybrid.state.stats.retractions > 0
    want = run(schedulers(plain=True, max_total_tokens=256, page_size=4), prompts, params)
    assert_same_outputs(got, want)


@pytest.mark.parametrize(("options", "reason"), [
    ({"tp_size": 2}, "tensor-parallel"),
    ({"disaggregation_mode": "prefill"}, "disaggregation"),
    ({"attention_backend": "triton"}, "slot map"),
])
def test_cases_the_hybrid_pool_does_not_cover_keep_every_tokens_kv(mistral_dir, monkeypatch,
                                                                    options, reason):
    from radixlm.models.model_config import ModelConfig

    # (triton runs on CUDA only: the layout is asked as it would be there)
    monkeypatch.setattr(kv_pool_layout, "resolve_backend_name", lambda request: request.name
                        if request.name != "auto" else "torch_native")
    args = ServerArgs(str(mistral_dir), dtype="float32", **options)
    config = ModelConfig.from_path(str(mistral_dir))
    assert config.sliding_window == W
    found = kv_pool_layout.plain_pool_reason(args, config, torch.device("cpu"))
    assert found is not None and reason in found
    assert kv_pool_layout.windowed_layout(args, config, torch.device("cpu"), 4096, 512) is None


def test_the_local_pool_is_sized_for_the_running_windows_and_chunks(mistral_dir):
    from radixlm.models.model_config import ModelConfig

    args = ServerArgs(str(mistral_dir), dtype="float32", page_size=4, max_running_requests=8,
                      chunked_prefill_size=16)
    config = ModelConfig.from_path(str(mistral_dir))
    layout = kv_pool_layout.windowed_layout(args, config, torch.device("cpu"), 4096, 512)
    running = 8 * (W + 2 * 4 + 16)
    assert layout.local_tokens == running + running // 2
    assert layout.sliding_layers == frozenset({0, 1})
    small = kv_pool_layout.windowed_layout(args, config, torch.device("cpu"), 64, 512)
    assert small.local_tokens == 64  # never more than the full pool


def test_a_short_local_pool_evicts_the_caches_local_kv_and_keeps_the_results(schedulers,
                                                                              monkeypatch):
    """Prompts the tree keeps fill the local pool (8 requests' windows and chunks, and half
    as much again) long before the full one: the tree gives up local KV outside every
    window, keeping the full KV, and the results stay the plain pool's."""
    hybrid = schedulers()
    hybrid.flush_cache()
    evicted = []
    evict_local = hybrid.memory.tree_cache.evict_local

    def counting(num_tokens):
        evicted.append(evict_local(num_tokens))
        return evicted[-1]

    monkeypatch.setattr(hybrid.memory.tree_cache, "evict_local", counting)
    prompts = [random_ids(90 + seed, 60) for seed in range(12)]
    params = [greedy(20)] * 12
    got = run(hybrid, prompts, params)
    assert sum(evicted) > 0
    assert hybrid.memory.tree_cache.total_size() >= 12 * 60  # the full KV stayed
    again = run(hybrid, prompts[:2], params[:2])  # hits cut back where local KV went
    want = run(schedulers(plain=True, disable_radix_cache=True), prompts, params)
    assert_same_outputs(got + again, want + want[:2])
