"""Gemma 2 and Gemma 3 (text) against transformers on the same tiny weights (float32): prompt
logprobs and greedy tokens alone, batched, in 16-token prefill chunks, with the radix cache
serving a prefix, inside and beyond the 12-token window; and the pieces that need no engine
(registry, per-layer windows and RoPE, the CPU decode runner's one step for all layers).
Gemma 3's multimodal checkpoints (``Gemma3ForConditionalGeneration``) serve their text
decoder: its weights, and in the slow stage its outputs, equal transformers'."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import (
    WINDOW,
    WINDOWED_ARCHITECTURES,
    reference_model,
    write_tiny_gemma3_multimodal,
)
from windowed_model_checks import (
    CHUNK,
    SMALL_POOL,
    check_alone_and_batched,
    check_prefix_cache_hit,
    check_retraction,
)

import radixlm
from radixlm.models.gemma import (
    FULL,
    SLIDING,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    gemma3_rope_parameters,
    text_decoder_weights,
)
from radixlm.models.layers.layernorm import GemmaRMSNorm
from radixlm.models.loader import load_model
from radixlm.models.model_config import ModelConfig, attention_windows
from radixlm.models.registry import model_class
from radixlm.runtime.model_executor.cpu_decode_runner import CpuDecodeRunner

GEMMAS = ["Gemma2ForCausalLM", "Gemma3ForCausalLM"]


def tiny_config(architecture: str) -> transformers.PretrainedConfig:
    config_class, extra = WINDOWED_ARCHITECTURES[architecture]
    return config_class(vocab_size=384, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        **extra)


def test_gemma_architectures_are_registered():
    assert model_class("Gemma2ForCausalLM") is Gemma2ForCausalLM
    assert model_class("Gemma3ForCausalLM") is Gemma3ForCausalLM


@pytest.mark.parametrize("architecture", GEMMAS)
def test_local_layers_get_the_window_softcap_and_their_own_rope(architecture):
    config = tiny_config(architecture)
    model = model_class(architecture)(config, max_position=64)
    assert attention_windows(config) == (WINDOW, frozenset({0}))
    local, full = (layer.self_attn.attn for layer in model.layers)
    assert (local.sliding_window, full.sliding_window) == (WINDOW, None)
    assert local.scaling == full.scaling == 24**-0.5
    softcap = 2.0 if architecture == "Gemma2ForCausalLM" else None
    assert local.logit_softcap == full.logit_softcap == softcap
    assert [layer.layer_type for layer in model.layers] == [SLIDING, FULL]
    rope = model.rotary_emb.lookup(torch.tensor([5]), torch.float32)
    if architecture == "Gemma3ForCausalLM":  # theta 100 locally, 10000 / 2 globally
        assert not torch.equal(rope[SLIDING][0], rope[FULL][0])
        assert isinstance(model.layers[0].self_attn.q_norm, GemmaRMSNorm)


def test_gemma3_rope_of_a_4x_config_reads_rope_local_base_freq_and_rope_scaling():
    config = transformers.PretrainedConfig(
        rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"type": "linear", "factor": 8})
    params = gemma3_rope_parameters(config)
    assert params[SLIDING] == {"rope_type": "default", "rope_theta": 1e4}
    assert params[FULL]["rope_type"] == "linear"
    assert (params[FULL]["factor"], params[FULL]["rope_theta"]) == (8, 1e6)


def test_gemma_norm_scales_by_one_plus_weight_in_float32():
    norm = GemmaRMSNorm(8)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.5, 0.5, 8))
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    expected = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    expected = (expected * (1 + norm.weight)).to(torch.bfloat16)
    torch.testing.assert_close(norm(x), expected, atol=0, rtol=0)


@pytest.mark.parametrize("architecture", GEMMAS)
def test_cpu_decode_runner_runs_gemma_layers_as_one_sandwich_stack(architecture):
    """Their steps against the modules: tests/models/layers/test_cpu_sandwich_decode.py."""
    model = model_class(architecture)(tiny_config(architecture), max_position=64)
    runner = CpuDecodeRunner.build(model)
    assert runner.stack is None and len(runner.sandwich.layers) == 2


@pytest.mark.parametrize("architecture", GEMMAS)
def test_prompt_logprobs_and_greedy_tokens_match_transformers(
    engine_for, tiny_model_dir, architecture
):
    """Alone and batched, prompts inside and beyond the window, long ones in chunks; then a
    radix cache hit on a prefix longer than the window."""
    engine = engine_for(architecture, "gqa", True, chunked_prefill_size=CHUNK)
    path = tiny_model_dir(architecture, "gqa", True)
    check_alone_and_batched(engine, path)
    check_prefix_cache_hit(engine, path)


@pytest.mark.slow  # an engine of its own per variant
@pytest.mark.parametrize(("kv", "tied"), [("mha", False), ("mqa", True)])
def test_gemma2_head_layouts_and_an_untied_head_match_transformers(
    engine_for, tiny_model_dir, kv, tied
):
    engine = engine_for("Gemma2ForCausalLM", kv, tied, chunked_prefill_size=CHUNK)
    check_alone_and_batched(engine, tiny_model_dir("Gemma2ForCausalLM", kv, tied))


@pytest.mark.slow  # an engine of its own
def test_gemma2_requests_retracted_for_lack_of_kv_keep_transformers_tokens(
    engine_for, tiny_model_dir
):
    engine = engine_for("Gemma2ForCausalLM", "gqa", True, chunked_prefill_size=CHUNK,
                        **SMALL_POOL)
    check_retraction(engine, tiny_model_dir("Gemma2ForCausalLM", "gqa", True))


# Gemma 3's multimodal checkpoints, served as text ----------------------------------------------


@pytest.fixture(scope="module")
def multimodal_gemma3(tmp_path_factory):
    return write_tiny_gemma3_multimodal(tmp_path_factory.mktemp("gemma3-multimodal"))


def test_a_multimodal_gemma3_loads_its_text_decoder_and_leaves_the_vision_tower(
        multimodal_gemma3):
    config = ModelConfig.from_path(multimodal_gemma3)
    assert config.architecture == "Gemma3ForConditionalGeneration"
    assert config.text_config.model_type == "gemma3_text"
    assert config.hf_config.model_type == "gemma3"
    assert (config.num_layers, config.num_heads, config.sliding_window) == (2, 4, WINDOW)
    model = load_model(config, torch.float32, torch.device("cpu"), max_position=64)
    assert isinstance(model, Gemma3ForConditionalGeneration)
    reference = reference_model(multimodal_gemma3).model.language_model
    ours = dict(model.named_parameters())
    assert torch.equal(ours["embed_tokens.weight"], reference.embed_tokens.weight)
    assert torch.equal(ours["layers.1.post_feedforward_layernorm.weight"],
                       reference.layers[1].post_feedforward_layernorm.weight)
    assert torch.equal(ours["layers.0.self_attn.qkv_proj.weight"][:64],
                       reference.layers[0].self_attn.q_proj.weight)


def test_text_decoder_weights_rename_both_layouts_and_drop_only_the_image_parts():
    names = ["language_model.model.norm.weight", "model.language_model.layers.0.x",
             "language_model.lm_head.weight", "vision_tower.a", "model.multi_modal_projector.b",
             "stray.weight"]
    renamed = [name for name, _ in text_decoder_weights((n, None) for n in names)]
    assert renamed == ["model.norm.weight", "model.layers.0.x", "lm_head.weight",
                       "stray.weight"]


@pytest.mark.slow  # an engine of its own
def test_a_multimodal_gemma3_serves_what_transformers_computes_for_text(multimodal_gemma3):
    with radixlm.Engine(str(multimodal_gemma3), dtype="float32", max_total_tokens=2048,
                        chunked_prefill_size=CHUNK) as engine:
        check_alone_and_batched(engine, multimodal_gemma3)
