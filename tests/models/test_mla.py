"""Multi-head latent attention: the absorbed form over the latent pool against the decompressed
computation (a naive loop here, and transformers' DeepSeek attention modules)."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

from radixlm.kernels.attention.torch_native_backend import TorchNativeAttentionBackend
from radixlm.kernels.forward_batch import ForwardBatch, ForwardMode
from radixlm.kv_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool
from radixlm.models.layers.attention import PagedAttention
from radixlm.models.layers.mla import MultiHeadLatentAttention
from radixlm.models.layers.rotary_embedding import RotaryEmbedding
from radixlm.models.model_config import rope_parameters
from radixlm.models.weight_loading import load_named_weights

HEADS, NOPE, ROPE, V_DIM, RANK = 4, 16, 8, 12, 32
CONTEXT = 128
YARN = {
    "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
    "mscale": 1.0, "mscale_all_dim": 0.8, "rope_theta": 10000.0,
}


SLOTS_PER_REQUEST = 32


def make_batch(mode, prefix_lens, extend_lens, pool, req_pool) -> ForwardBatch:
    """Request b owns row b and slots 1 + 32 b, 1 + 32 b + 1, ... (slot 0 is padding); its
    prefix is assumed already in the pool."""
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    out_cache_loc, positions = [], []
    for row, (prefix, seq_len) in enumerate(zip(prefix_lens, seq_lens, strict=True)):
        first = 1 + row * SLOTS_PER_REQUEST
        req_pool.req_to_token[row, :seq_len] = torch.arange(first, first + seq_len)
        out_cache_loc.extend(range(first + prefix, first + seq_len))
        positions.extend(range(prefix, seq_len))

    def as_tensor(values):
        return torch.tensor(values, dtype=torch.int64)

    return ForwardBatch(
        mode=mode, input_ids=torch.zeros(len(positions), dtype=torch.int64),
        positions=as_tensor(positions), out_cache_loc=as_tensor(out_cache_loc),
        req_pool_indices=as_tensor(list(range(len(seq_lens)))), seq_lens=as_tensor(seq_lens),
        prefix_lens=as_tensor(prefix_lens), extend_seq_lens=as_tensor(extend_lens),
        req_to_token=req_pool.req_to_token, kv_pool=pool,
        attn_backend=TorchNativeAttentionBackend(), seq_lens_list=seq_lens,
        extend_seq_lens_list=list(extend_lens),
    )


def run_layer(layer, rope, x, mode, prefix_lens, extend_lens, pool, req_pool):
    batch = make_batch(mode, prefix_lens, extend_lens, pool, req_pool)
    batch.attn_backend.init_forward_metadata(batch)
    with torch.inference_mode():
        return layer(rope.lookup(batch.positions, x.dtype), x, batch)


# The attention core on the same inputs -----------------------------------------------------


def decompressed_attention(q_nope, q_rope, latent, k_rope, w_uk, w_uv, scale):
    """The unabsorbed MLA of one decode query, head by head, in float64.

    q_nope (H, nope), q_rope (H, rope); latent (S, R), k_rope (S, rope);
    w_uk (H, nope, R), w_uv (H, v, R) -> (H, v)."""
    out = []
    for h in range(q_nope.shape[0]):
        keys = torch.cat([latent @ w_uk[h].T, k_rope], dim=-1)  # (S, nope + rope)
        values = latent @ w_uv[h].T  # (S, v)
        scores = keys @ torch.cat([q_nope[h], q_rope[h]]) * scale  # (S,)
        out.append(torch.softmax(scores, dim=0) @ values)
    return torch.stack(out)


@pytest.mark.parametrize("seq_lens", [[1, 9, 23], [17]])
def test_absorbed_decode_over_the_latent_pool_equals_the_decompressed_computation(seq_lens):
    gen = torch.Generator().manual_seed(0)
    w_uk = torch.randn(HEADS, NOPE, RANK, generator=gen) / RANK**0.5
    w_uv = torch.randn(HEADS, V_DIM, RANK, generator=gen) / RANK**0.5
    pool_slots = 1 + len(seq_lens) * SLOTS_PER_REQUEST
    pool = MLATokenToKVPool(pool_slots, 1, RANK, ROPE, torch.float32, "cpu")
    pool.kv_buffers[0].normal_(generator=gen)  # latents + rope keys of every cached token
    req_pool = ReqToTokenPool(len(seq_lens), CONTEXT, "cpu")
    batch = make_batch(ForwardMode.DECODE, [n - 1 for n in seq_lens], [1] * len(seq_lens),
                       pool, req_pool)
    q_nope = torch.randn(len(seq_lens), HEADS, NOPE, generator=gen)
    q_rope = torch.randn(len(seq_lens), HEADS, ROPE, generator=gen)
    new_rows = torch.randn(len(seq_lens), 1, RANK + ROPE, generator=gen)
    scale = (NOPE + ROPE) ** -0.5

    # Absorbed: W_UK folded into the query, MQA over latent rows, W_UV after.
    q_latent = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)
    query = torch.cat([q_latent, q_rope], dim=-1)  # (B, H, R + rope)
    layer = PagedAttention(0, HEADS, 1, RANK + ROPE, scale, v_head_dim=RANK)
    batch.attn_backend.init_forward_metadata(batch)
    out_latent = batch.attn_backend.forward_decode(
        query, new_rows, new_rows[..., :RANK], layer, batch
    )  # (B, H, R)
    absorbed = torch.einsum("bhr,hvr->bhv", out_latent, w_uv)

    buffer = pool.kv_buffers[0][:, 0].double()
    for b, slots in enumerate(req_pool.req_to_token[: len(seq_lens)]):
        rows = buffer[slots[: seq_lens[b]]]  # (S, R + rope), the new token's row included
        expected = decompressed_attention(
            q_nope[b].double(), q_rope[b].double(), rows[:, :RANK], rows[:, RANK:],
            w_uk.double(), w_uv.double(), scale,
        )
        torch.testing.assert_close(absorbed[b].double(), expected, atol=1e-5, rtol=0)


# The whole layer against transformers ------------------------------------------------------


def hf_attention(model_type: str, interleave: bool, q_lora_rank, rope: dict):
    """A transformers DeepSeek attention module with random weights, and its RoPE module."""
    config_class, module = {
        "deepseek_v2": (transformers.DeepseekV2Config, hf_v2),
        "deepseek_v3": (transformers.DeepseekV3Config, hf_v3),
    }[model_type]
    extra = {"rope_interleave": interleave} if model_type == "deepseek_v3" else {}
    config = config_class(
        hidden_size=64, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        kv_lora_rank=RANK, q_lora_rank=q_lora_rank, qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE, v_head_dim=V_DIM, max_position_embeddings=CONTEXT,
        rope_parameters=dict(rope), **extra,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(1)
    prefix = "DeepseekV2" if model_type == "deepseek_v2" else "DeepseekV3"
    attention = getattr(module, f"{prefix}Attention")(config, layer_idx=0).eval()
    with torch.no_grad():  # non-trivial latent norms
        for norm in (attention.kv_a_layernorm, attention.q_a_layernorm):
            if norm is not None:
                norm.weight.uniform_(0.5, 1.5)
    return config, attention, getattr(module, f"{prefix}RotaryEmbedding")(config)


@torch.inference_mode()
def hf_forward(attention, rotary, x: torch.Tensor) -> torch.Tensor:
    """transformers' decompressed attention over one causal sequence x (S, hidden)."""
    s = x.shape[0]
    positions = torch.arange(s)[None]
    mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
    out, _ = attention(x[None], position_embeddings=rotary(x[None], positions),
                       attention_mask=mask)
    return out[0]


VARIANTS = {
    "v2_complex_rope_no_q_lora": ("deepseek_v2", True, None, {"rope_type": "default"}),
    "v2_q_lora_yarn": ("deepseek_v2", True, 24, YARN),
    "v3_interleaved_q_lora": ("deepseek_v3", True, 24, {"rope_type": "default"}),
    "v3_rotate_half_yarn": ("deepseek_v3", False, None, YARN),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_layer_prefill_then_decode_matches_transformers_decompressed_attention(variant):
    """Two ragged requests prefilled together, then decoded together: every output row of
    the absorbed layer equals transformers' decompressed attention on the same hidden states."""
    model_type, interleave, q_lora_rank, rope_params = VARIANTS[variant]
    config, attention, rotary = hf_attention(model_type, interleave, q_lora_rank,
                                             {**rope_params, "rope_theta": 10000.0})
    ours = MultiHeadLatentAttention(config, 0, rope_interleaved=interleave,
                                    trained_context=CONTEXT)
    load_named_weights(ours, attention.state_dict().items(), {})
    ours.process_weights_after_loading()
    rope = RotaryEmbedding(ROPE, CONTEXT, rope_parameters(config), CONTEXT)

    lens = [11, 6]
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(n + 1, 64, generator=gen) for n in lens]  # prompt + one decoded token
    pool = MLATokenToKVPool(1 + 2 * SLOTS_PER_REQUEST, 1, RANK, ROPE, torch.float32, "cpu")
    req_pool = ReqToTokenPool(2, CONTEXT, "cpu")
    prefill = run_layer(ours, rope, torch.cat([x[:-1] for x in xs]), ForwardMode.EXTEND,
                        [0, 0], lens, pool, req_pool)
    decode = run_layer(ours, rope, torch.stack([x[-1] for x in xs]), ForwardMode.DECODE,
                       lens, [1, 1], pool, req_pool)
    for b, x in enumerate(xs):
        expected = hf_forward(attention, rotary, x)
        rows = slice(sum(lens[:b]), sum(lens[: b + 1]))
        torch.testing.assert_close(prefill[rows], expected[:-1], atol=1e-5, rtol=0)
        torch.testing.assert_close(decode[b], expected[-1], atol=1e-5, rtol=0)


def test_weights_are_split_for_absorption_once_at_load_time():
    config, attention, _ = hf_attention("deepseek_v3", True, None, {"rope_type": "default"})
    ours = MultiHeadLatentAttention(config, 0, rope_interleaved=True, trained_context=CONTEXT)
    load_named_weights(ours, attention.state_dict().items(), {})
    ours.process_weights_after_loading()
    w_kv = attention.kv_b_proj.weight.detach().view(HEADS, NOPE + V_DIM, RANK)
    assert torch.equal(ours.w_uk, w_kv[:, :NOPE])
    assert torch.equal(ours.w_uv, w_kv[:, NOPE:].transpose(1, 2))
    assert not hasattr(ours, "kv_b_proj")  # the decompressing projection is gone
    assert ours.attn.head_dim == RANK + ROPE and ours.attn.v_head_dim == RANK
    assert ours.attn.num_kv_heads == 1
