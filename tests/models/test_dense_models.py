"""Every dense architecture against transformers on the same tiny weights (float32)."""

from __future__ import annotations

import pytest
import torch
import transformers
from runtime_checks import assert_engine_idle
from tiny_models import (
    ARCHITECTURES,
    KV_HEADS,
    WINDOW,
    reference_greedy,
    reference_model,
    reference_prompt_logprobs,
)
from windowed_model_checks import CHUNK, check_alone_and_batched, check_prefix_cache_hit

import radixlm
from radixlm.models.llama import MistralForCausalLM
from radixlm.runtime.model_executor.cpu_decode_runner import CpuDecodeRunner

PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of France; Berlin is",
    "def add(a, b):",
    "In 1492, Columbus sailed the ocean blue. Numbers: 0 1 2 3",
    "Héllo",
    "The lazy dog jumps over the quick brown fox. The capital of Germany is Berlin and",
    "a",
    "Numbers: 9 8 7 6 5 4 3 2 1 0",
]
GREEDY = {"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True}
FAST = {("LlamaForCausalLM", "gqa", False), ("LlamaForCausalLM", "mha", True),
        ("MistralForCausalLM", "mqa", False), ("Qwen2ForCausalLM", "gqa", True),
        ("Qwen3ForCausalLM", "mha", False), ("Qwen3ForCausalLM", "mqa", True)}
"""Every architecture, KV layout and tied head at least once in the default run; the other
combinations in CI's last stage (keeping the default run under its time budget)."""
VARIANTS = [
    pytest.param(arch, kv, tied, marks=() if (arch, kv, tied) in FAST else pytest.mark.slow)
    for arch in ARCHITECTURES for kv in KV_HEADS for tied in (False, True)
]


@pytest.mark.parametrize(("architecture", "kv", "tied"), VARIANTS)
def test_prompt_logprobs_and_greedy_tokens_match_transformers(
    engine_for, tiny_model_dir, architecture, kv, tied
):
    engine = engine_for(architecture, kv, tied)
    path = tiny_model_dir(architecture, kv, tied)
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    alone = [
        engine.generate(input_ids=i, sampling_params=GREEDY, return_logprob=True,
                        logprob_start_len=0)
        for i in ids[:3]
    ]
    together = engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True,
                               logprob_start_len=0)
    for prompt_ids, out in zip(ids, together):
        expected = reference_greedy(path, prompt_ids, 32)
        assert out["output_ids"] == expected
        ours = out["meta_info"]["input_token_logprobs"]
        assert ours[0] == [None, prompt_ids[0], None]
        theirs = reference_prompt_logprobs(path, prompt_ids)
        got = torch.tensor([entry[0] for entry in ours[1:]])
        torch.testing.assert_close(got, theirs, atol=1e-4, rtol=0)
    for out, batched in zip(alone, together):
        assert out["output_ids"] == batched["output_ids"]


@pytest.mark.slow  # an engine of its own (~11 s): CI's last stage
def test_sharded_checkpoint_loads_like_a_single_file(tmp_path, engine_for, tiny_model_dir):
    single = tiny_model_dir("LlamaForCausalLM", "gqa", False)
    sharded = tmp_path / "sharded"
    reference_model(single).save_pretrained(sharded, max_shard_size="100KB")
    engine_for().tokenizer.save_pretrained(sharded)
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    with radixlm.Engine(str(sharded), dtype="float32", max_total_tokens=1024) as engine:
        ids = engine.tokenizer.encode(PROMPTS[1])
        out = engine.generate(input_ids=ids, sampling_params=GREEDY)
    assert out["output_ids"] == reference_greedy(single, ids, 32)


def test_mistral_sliding_window_reaches_every_layer_and_keeps_the_cpu_decode_kernels_off():
    config = transformers.MistralConfig(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW)
    model = MistralForCausalLM(config, max_position=64)
    assert [layer.self_attn.attn.sliding_window for layer in model.layers] == [WINDOW] * 2
    assert CpuDecodeRunner.build(model) is None
    unwindowed = MistralForCausalLM(transformers.MistralConfig(**{
        **config.to_dict(), "sliding_window": None}), max_position=64)
    assert [layer.self_attn.attn.sliding_window for layer in unwindowed.layers] == [None] * 2


@pytest.mark.slow  # an engine of its own
def test_mistral_with_a_sliding_window_matches_transformers(tiny_model_dir):
    path = tiny_model_dir("MistralForCausalLM", "gqa", False, sliding_window=WINDOW)
    with radixlm.Engine(str(path), dtype="float32", max_total_tokens=2048,
                        chunked_prefill_size=CHUNK, chunked_prefill_step_ms=None) as engine:
        check_alone_and_batched(engine, path)
        check_prefix_cache_hit(engine, path)
        assert_engine_idle(engine)
