"""Phi-3 against transformers on the same tiny weights (float32): fused checkpoint projections,
LongRoPE on half of each head, a 12-token window on every layer; prompt logprobs and greedy
tokens alone, batched, in prefill chunks and with a radix cache hit. Also the LongRoPE
table against transformers' frequencies, and the CPU decode runner leaving these layers
alone."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import WINDOW, WINDOWED_ARCHITECTURES
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from windowed_model_checks import CHUNK, check_alone_and_batched, check_prefix_cache_hit

from radixlm.models.layers.rotary_embedding import RotaryEmbedding
from radixlm.models.phi3 import Phi3ForCausalLM, phi3_rope_parameters, rotary_dim, split_fused
from radixlm.models.registry import model_class
from radixlm.runtime.model_executor.cpu_decode_runner import CpuDecodeRunner


def tiny_config(**overrides) -> transformers.Phi3Config:
    config_class, extra = WINDOWED_ARCHITECTURES["Phi3ForCausalLM"]
    fields = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  **extra)
    return config_class(**{**fields, **overrides})


def test_phi3_is_registered_and_every_layer_gets_the_window():
    assert model_class("Phi3ForCausalLM") is Phi3ForCausalLM
    model = Phi3ForCausalLM(tiny_config(), max_position=128)
    assert [layer.self_attn.attn.sliding_window for layer in model.layers] == [WINDOW] * 2
    assert [layer.self_attn.rotary_dim for layer in model.layers] == [8, 8]
    assert CpuDecodeRunner.build(model) is None


@pytest.mark.parametrize("positions", [(0, 64), (64, 128)], ids=["short", "long"])
def test_longrope_table_uses_short_factors_below_the_original_context_long_beyond(positions):
    """Our angles equal transformers' inverse frequencies for the part of the positions each
    factor set serves (transformers picks one set per sequence length)."""
    config = tiny_config()
    ours = RotaryEmbedding(rotary_dim(config), 128, phi3_rope_parameters(config),
                           trained_context=config.max_position_embeddings)
    start, stop = positions
    seq_len = None if start == 0 else stop
    inv_freq, factor = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=seq_len)
    angles = torch.outer(torch.arange(start, stop, dtype=torch.float32), inv_freq)
    assert ours.attention_factor == pytest.approx(factor)
    cos, sin = ours.cos_sin(torch.arange(start, stop))
    torch.testing.assert_close(cos, angles.cos() * factor)
    torch.testing.assert_close(sin, angles.sin() * factor)


def test_fused_tensors_split_into_llama_names_and_bad_rows_are_named():
    config = tiny_config()
    qkv = torch.arange(128 * 64, dtype=torch.float32).view(128, 64)
    gate_up = torch.randn(256, 64)
    out = dict(split_fused([("model.layers.0.self_attn.qkv_proj.weight", qkv),
                            ("model.layers.0.mlp.gate_up_proj.weight", gate_up)], config))
    assert torch.equal(out["model.layers.0.self_attn.q_proj.weight"], qkv[:64])
    assert torch.equal(out["model.layers.0.self_attn.k_proj.weight"], qkv[64:96])
    assert torch.equal(out["model.layers.0.self_attn.v_proj.weight"], qkv[96:])
    assert torch.equal(out["model.layers.0.mlp.gate_proj.weight"], gate_up[:128])
    assert torch.equal(out["model.layers.0.mlp.up_proj.weight"], gate_up[128:])
    with pytest.raises(ValueError, match="qkv_proj"):
        list(split_fused([("model.layers.0.self_attn.qkv_proj.weight", qkv[:100])], config))


def test_prompt_logprobs_and_greedy_tokens_match_transformers(engine_for, tiny_model_dir):
    engine = engine_for("Phi3ForCausalLM", "gqa", False, chunked_prefill_size=CHUNK)
    path = tiny_model_dir("Phi3ForCausalLM", "gqa", False)
    check_alone_and_batched(engine, path)
    check_prefix_cache_hit(engine, path)
