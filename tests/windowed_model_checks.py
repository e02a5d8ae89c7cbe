"""Checks shared by the sliding-window models' tests (Gemma 2/3, Phi-3, Mistral with a window):
one engine per model with small prefill chunks, run against transformers on the same tiny
weights (float32) for prompts inside and beyond the window, alone, batched, and with the
radix cache serving a prefix longer than the window; and retraction."""

from __future__ import annotations

from tiny_models import WINDOW, assert_prompt_logprobs_match, reference_greedy
from workloads import random_ids

# Short prompts fit in the window; the long ones cross it (and the 16-token prefill chunks).
PROMPTS = [
    "The quick brown fox",
    "Héllo",
    "Paris is the capital of France; Berlin is the capital of Germany. The quick brown fox",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n",
    "In 1492, Columbus sailed the ocean blue. Numbers: 0 1 2 3 4 5 6 7 8 9.",
]
SHARED_PREFIX = "The lazy dog jumps over the quick brown fox. The capital of Germany is Berlin."
SUFFIXES = [" Paris is the capital of", " Numbers: 9 8 7"]
CHUNK = 16
"""The engines' chunked_prefill_size: every long prompt is prefilled in several chunks."""
GREEDY = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}


def assert_matches_transformers(path, prompt_ids: list[int], out: dict, start: int = 0) -> None:
    """Greedy tokens equal transformers'; prompt logprobs from token start+1 on within 1e-4."""
    assert out["output_ids"] == reference_greedy(path, prompt_ids, GREEDY["max_new_tokens"])
    assert_prompt_logprobs_match(path, prompt_ids, out, start)


def check_alone_and_batched(engine, path) -> None:
    """Each prompt alone and all of them in one batch: the same tokens, transformers' tokens
    and logprobs, for prompts shorter and longer than the window."""
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    assert min(map(len, ids)) < WINDOW < CHUNK < max(map(len, ids))
    alone = [engine.generate(input_ids=i, sampling_params=GREEDY, return_logprob=True,
                             logprob_start_len=0) for i in ids]
    together = engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True,
                               logprob_start_len=0)
    for prompt_ids, out in zip(ids, together):
        assert_matches_transformers(path, prompt_ids, out)
    assert [o["output_ids"] for o in alone] == [o["output_ids"] for o in together]


def check_prefix_cache_hit(engine, path) -> None:
    """A cached prefix longer than the window is reused by prompts extending it, and they
    still match transformers token for token."""
    engine.flush_cache()
    prefix = engine.tokenizer.encode(SHARED_PREFIX)
    assert len(prefix) > WINDOW
    engine.generate(input_ids=prefix, sampling_params={**GREEDY, "max_new_tokens": 1})
    prompts = [prefix + engine.tokenizer.encode(s) for s in SUFFIXES]
    start = len(prefix) - 1
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True,
                           logprob_start_len=start)
    for prompt_ids, out in zip(prompts, outs):
        assert out["meta_info"]["cached_tokens"] >= len(prefix) // 2
        assert_matches_transformers(path, prompt_ids, out, start=start)


# Far too small for the requests at once: decode runs out of KV and retracts some of them.
SMALL_POOL = dict(max_total_tokens=320, max_running_requests=16, init_new_token_ratio=0.01,
                  min_new_token_ratio=0.01, new_token_ratio_decay=0.5)


def check_retraction(engine, path) -> None:
    """Requests retracted when the pool runs out (their KV freed, recomputed later, windows
    and all) still produce transformers' greedy tokens."""
    engine.flush_cache()
    prompts = [random_ids(seed, 8 + 3 * seed) for seed in range(12)]
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert sum(out["meta_info"]["total_retractions"] for out in outs) > 0
    for prompt_ids, out in zip(prompts, outs):
        assert out["output_ids"] == reference_greedy(path, prompt_ids, GREEDY["max_new_tokens"])
