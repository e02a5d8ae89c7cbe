"""Mixtral, Qwen2-MoE and Qwen3-MoE against transformers on the same tiny weights (float32):
prompt logprobs, greedy tokens alone and in a mixed batch, and with the radix cache
serving part of the prompt."""

from __future__ import annotations

import pytest
from tiny_models import MOE_ARCHITECTURES, assert_prompt_logprobs_match, reference_greedy

from radixlm.models.layers.moe import MoEBlock
from radixlm.models.mixtral import MixtralForCausalLM
from radixlm.models.qwen_moe import Qwen2MoeForCausalLM, is_moe_layer
from radixlm.models.registry import model_class

PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of France; Berlin is",
    "def add(a, b):",
    "In 1492, Columbus sailed the ocean blue. Numbers: 0 1 2 3",
    "Héllo",
    "a",
]
SHARED_PREFIX = "The lazy dog jumps over the quick brown fox. The capital of Germany is Berlin."
SUFFIXES = [" Paris is the capital of", " def add(a, b):\n    return", " Numbers: 9 8 7"]
UNRELATED = "In 1492, Columbus sailed the ocean blue. Numbers: 0 1 2 3 4 5 6 7 8 9. Héllo wörld"
GREEDY = {"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True}


def test_moe_architectures_are_registered():
    assert model_class("MixtralForCausalLM") is MixtralForCausalLM
    assert model_class("Qwen2MoeForCausalLM") is Qwen2MoeForCausalLM
    assert model_class("Qwen3MoeForCausalLM").__name__ == "Qwen3MoeForCausalLM"


@pytest.mark.parametrize("architecture", MOE_ARCHITECTURES)
def test_prompt_logprobs_and_greedy_tokens_match_transformers(
    engine_for, tiny_model_dir, architecture
):
    engine = engine_for(architecture)
    path = tiny_model_dir(architecture)
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    alone = [
        engine.generate(input_ids=i, sampling_params=GREEDY, return_logprob=True,
                        logprob_start_len=0)
        for i in ids[:2]
    ]
    together = engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True,
                               logprob_start_len=0)
    for prompt_ids, out in zip(ids, together):
        assert out["output_ids"] == reference_greedy(path, prompt_ids, 32)
        assert_prompt_logprobs_match(path, prompt_ids, out, start=0)
    for out, batched in zip(alone, together):
        assert out["output_ids"] == batched["output_ids"]


@pytest.mark.parametrize("architecture", MOE_ARCHITECTURES)
def test_radix_cache_hit_on_part_of_the_prompt_matches_transformers(
    engine_for, tiny_model_dir, architecture
):
    """A shared prefix is computed once; prompts extending it (batched with an unrelated
    one) reuse its KV and still match transformers token for token."""
    engine = engine_for(architecture)
    path = tiny_model_dir(architecture)
    engine.flush_cache()
    prefix = engine.tokenizer.encode(SHARED_PREFIX)
    engine.generate(input_ids=prefix, sampling_params={**GREEDY, "max_new_tokens": 1})
    prompts = [prefix + engine.tokenizer.encode(s) for s in SUFFIXES]
    fresh = engine.tokenizer.encode(UNRELATED)
    start = len(prefix) - 1
    assert len(fresh) > start + 1
    outs = engine.generate(
        input_ids=[*prompts, fresh], sampling_params=GREEDY, return_logprob=True,
        logprob_start_len=start,
    )
    for prompt_ids, out in zip(prompts, outs):
        assert out["meta_info"]["cached_tokens"] >= len(prefix) // 2
        assert out["meta_info"]["cached_tokens"] < len(prompt_ids)
        assert out["output_ids"] == reference_greedy(path, prompt_ids, 32)
        assert_prompt_logprobs_match(path, prompt_ids, out, start=start)
    assert outs[-1]["meta_info"]["cached_tokens"] == 0
    assert outs[-1]["output_ids"] == reference_greedy(path, fresh, 32)
    assert_prompt_logprobs_match(path, fresh, outs[-1], start=start)


def test_qwen2_moe_layers_follow_sparse_step_and_mlp_only_layers(tiny_model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir("Qwen2MoeForCausalLM"))
    config.num_hidden_layers, config.decoder_sparse_step, config.mlp_only_layers = 6, 2, [3]
    assert [is_moe_layer(config, i) for i in range(6)] == [False, True, False, False,
                                                           False, True]
    model = Qwen2MoeForCausalLM(config, max_position=64)
    kinds = [isinstance(layer.mlp, MoEBlock) for layer in model.layers]
    assert kinds == [False, True, False, False, False, True]
    assert model.layers[1].mlp.shared_expert_gate is not None
