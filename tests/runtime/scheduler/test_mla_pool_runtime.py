"""The runtime on the latent (MLA) KV pool: chunked prefill, retraction, paged slots and prefix
sharing behave exactly as on the MHA pool. The model is the tiny DeepSeek-V3 (MLA + MoE)."""

from __future__ import annotations

import random

import torch
from runtime_checks import run_to_completion, scheduler_req
from tiny_models import reference_greedy, reference_prompt_logprobs
from workloads import greedy, random_ids

from radixlm.kernels.forward_batch import ForwardMode
from radixlm.kv_cache.memory_pool import MLATokenToKVPool

MODEL = ("DeepseekV3ForCausalLM", "mha")
CHUNK = 16
# Admission reserving almost nothing for running requests' remaining output: retractions.
BOLD = dict(init_new_token_ratio=0.01, min_new_token_ratio=0.01, new_token_ratio_decay=0.5)


def run(scheduler, prompts, params, **fields) -> list:
    reqs = [scheduler_req(scheduler, p, s, **fields) for p, s in zip(prompts, params)]
    run_to_completion(scheduler, reqs, max_steps=20_000)
    return reqs


def values(entries: list) -> torch.Tensor:
    return torch.tensor([e[0] for e in entries if e[0] is not None])


def test_a_long_prompt_prefilled_in_chunks_on_the_latent_pool_matches_transformers(
    scheduler_for, tiny_model_dir, monkeypatch
):
    scheduler = scheduler_for(*MODEL, chunked_prefill_size=CHUNK)
    assert isinstance(scheduler.runner.kv_pool, MLATokenToKVPool)
    scheduler.memory.flush()
    extends: list[list[int]] = []
    forward = scheduler.runner.forward

    def recording_forward(batch):
        if batch.mode == ForwardMode.EXTEND:
            extends.append(list(batch.extend_seq_lens_list))
        return forward(batch)

    monkeypatch.setattr(scheduler.runner, "forward", recording_forward)
    ids = random_ids(1, 10 * CHUNK)
    [req] = run(scheduler, [ids], [greedy(16)], return_logprob=True, logprob_start=0)
    assert len(extends) >= 10 and max(n for step in extends for n in step) <= CHUNK
    path = tiny_model_dir(*MODEL)
    assert req.output_ids == reference_greedy(path, ids, 16)
    torch.testing.assert_close(values(req.input_token_logprobs),
                               reference_prompt_logprobs(path, ids), atol=1e-4, rtol=0)
    # The finished chunks stay cached: a sibling prompt reuses them.
    [sibling] = run(scheduler, [ids[:100] + random_ids(2, 20)], [greedy(1)])
    assert sibling.cached_tokens == 100


def test_retraction_on_a_small_paged_latent_pool_keeps_every_request_s_tokens_and_logprobs(
    scheduler_for
):
    rng = random.Random(7)
    prompts = [random_ids(100 + i, rng.randint(10, 90)) for i in range(40)]
    params = [greedy(rng.randint(1, 40)) for _ in prompts]
    big = scheduler_for(*MODEL)
    small = scheduler_for(*MODEL, max_total_tokens=384, page_size=4,
                          chunked_prefill_size=CHUNK, **BOLD)
    big.memory.flush()
    small.memory.flush()
    want = run(big, prompts, params, return_logprob=True, logprob_start=2)
    assert sum(r.retractions for r in want) == 0
    before = small.state.stats.retractions
    got = run(small, prompts, params, return_logprob=True, logprob_start=2)
    assert sum(r.retractions for r in got) == small.state.stats.retractions - before > 0
    for ours, theirs in zip(got, want, strict=True):
        assert ours.output_ids == theirs.output_ids
        for key in ("input_token_logprobs", "output_token_logprobs"):
            mine, reference = getattr(ours, key), getattr(theirs, key)
            assert [e[1] for e in mine] == [e[1] for e in reference], key
            torch.testing.assert_close(values(mine), values(reference), atol=1e-5, rtol=0)
