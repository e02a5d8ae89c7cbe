"""LoRA adapters with speculative decoding (issue 61): drafts (n-gram chains and token trees,
or a draft model that runs without adapters) verified under each request's adapter give
transformers + peft's greedy tokens and logprobs, for a batch mixing adapters and the
base model; and drafts were verified, some accepted and some not."""

from __future__ import annotations

import random

import pytest
from lora_adapters import ALL, assert_matches_reference, write_peft_adapter

NEW_TOKENS = 12
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
ADAPTERS = {"all4": dict(r=4, lora_alpha=8, target_modules=ALL),
            "qv2": dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])}
SPECULATION = {
    "ngram-chains": {"speculative_algorithm": "NGRAM"},
    "ngram-trees": {"speculative_algorithm": "NGRAM", "speculative_ngram_max_bfs_breadth": 4,
                    "speculative_num_draft_tokens": 9},
    "draft-model": {"speculative_algorithm": "STANDALONE"},  # the tiny model drafting itself
}


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("spec-lora")
    return {name: write_peft_adapter(tiny_model_dir(), root / name, seed=50 + i, **config)
            for i, (name, config) in enumerate(ADAPTERS.items())}


def repeating_prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts of a random span repeated: continuations n-grams can guess."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        span = [rng.randrange(3, 300) for _ in range(rng.randint(3, 8))]
        prompts.append(span * 3 + span[: rng.randint(0, len(span))])
    return prompts


@pytest.mark.parametrize("kind", list(SPECULATION))
def test_speculated_outputs_under_adapters_equal_peft(engine_for, tiny_model_dir, adapters,
                                                       kind):
    options = dict(SPECULATION[kind], speculative_disable_by_batch_size=512)
    if kind == "draft-model":
        options["speculative_draft_model_path"] = str(tiny_model_dir())
    engine = engine_for(lora_paths=tuple(f"{n}={p}" for n, p in adapters.items()),
                        max_loras_per_batch=2, **options)
    before = engine.get_server_info()["stats"]
    prompts = repeating_prompts(6, seed=3)
    names = [[*ADAPTERS, None][i % 3] for i in range(len(prompts))]
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=names,
                           return_logprob=True)
    assert_matches_reference(tiny_model_dir(), adapters, prompts, names, outs, NEW_TOKENS)
    after = engine.get_server_info()["stats"]
    drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert after["spec_verify_steps"] > before["spec_verify_steps"]
    assert 0 < accepted < drafted, (accepted, drafted)
