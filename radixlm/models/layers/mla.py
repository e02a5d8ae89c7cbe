"""Multi-head latent attention (MLA; DeepSeek-V2, Liu et al. 2024, section 2.1), absorbed form.

Per token, with H heads, R = ``kv_lora_rank`` and head dims nope / rope / v:

    q        = W_Q x, or W_QB norm(W_QA x)          (H, nope + rope)   "q-LoRA" (V2, V3)
    c, k_r   = W_KVA x                              (R), (rope)
    c        = norm(c)                              the latent the KV pool caches
    q_r, k_r = RoPE(q_r), RoPE(k_r)                 k_r is shared by all heads
    decompressed:  k_h = [W_UK,h c ; k_r],  v_h = W_UV,h c
                   o_h = softmax(q_h . k_h * s) v_h
    absorbed:      o_h = W_UV,h ( softmax([q_nope,h W_UK,h ; q_r,h] . [c ; k_r] * s) c )

The two are equal because q_nope,h . (W_UK,h c) = (q_nope,h W_UK,h) . c. The absorbed form is
multi-query attention with one KV "head" of R + rope dims whose values are its first R
dims: the pool stores one (R + rope) row per token (``MLATokenToKVPool``) instead of
H x (nope + rope + v) numbers. This layer runs every pass (prefill and decode) absorbed,
through the attention backend, so the radix cache, chunked prefill and retraction see one
ordinary pool.

Under tensor parallelism each rank holds its share of the heads (q, W_UK, W_UV and the
output projection's columns) and the whole latent projection and pool.

Weights are prepared once, after loading (``process_weights_after_loading``):
``kv_b_proj`` (H (nope + v), R) is split into ``w_uk`` (H, nope, R) and ``w_uv``
(H, R, v); and DeepSeek's interleaved RoPE pairs ((x0, x1), (x2, x3), ...) are permuted
into the rotate-half layout of ``apply_rotary`` by reordering the rows of the q and k_r
projections. Scores only see q_r . k_r, which a shared permutation leaves unchanged.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from radixlm.kernels.forward_batch import ForwardBatch
from radixlm.models.layers import tensor_parallel
from radixlm.models.layers.attention import PagedAttention
from radixlm.models.layers.layernorm import RMSNorm
from radixlm.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from radixlm.models.layers.rope_scaling import yarn_softmax_scale
from radixlm.models.layers.rotary_embedding import apply_rotary
from radixlm.models.model_config import rope_parameters

LATENT_NORM_EPS = 1e-6
"""DeepSeek normalises the q and KV latents with RMSNorm's default eps, not ``rms_norm_eps``."""


def deinterleave_rows(weight: torch.Tensor, rope_rows: slice) -> None:
    """Reorders, in place, the rows ``rope_rows`` of ``weight`` from interleaved pairs
    (0, 1, 2, 3, ...) to rotate-half order (0, 2, 4, ..., 1, 3, 5, ...)."""
    block = weight[rope_rows]
    block.copy_(torch.cat([block[0::2], block[1::2]]))


class MultiHeadLatentAttention(nn.Module):
    """(T, hidden) -> (T, hidden), caching each token's normalised latent and rotated k_r."""

    def __init__(
        self, config: PretrainedConfig, layer_id: int, rope_interleaved: bool,
        trained_context: int,
    ):
        """``rope_interleaved``: the checkpoint rotates adjacent pairs (DeepSeek's layout)."""
        super().__init__()
        tp = tensor_parallel.current()  # this rank's heads; the latent is every rank's
        start, self.num_heads = tp.part(config.num_attention_heads, "attention heads")
        heads = config.num_attention_heads
        h = self.num_heads
        self.kv_lora_rank = r = config.kv_lora_rank
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.rope_interleaved = rope_interleaved
        qk_head_dim = self.nope_dim + self.rope_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.q_lora_rank = config.q_lora_rank
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(config.hidden_size, heads * qk_head_dim, False,
                                               start * qk_head_dim, h * qk_head_dim)
        else:
            self.q_a_proj = nn.Linear(config.hidden_size, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * qk_head_dim, False,
                                                 start * qk_head_dim, h * qk_head_dim)
        self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, r + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(r, LATENT_NORM_EPS)
        kv_b_rows = self.nope_dim + self.v_head_dim
        self.kv_b_proj = ColumnParallelLinear(r, heads * kv_b_rows, False, start * kv_b_rows,
                                              h * kv_b_rows)
        self.o_proj = RowParallelLinear(heads * self.v_head_dim, config.hidden_size, bias, tp,
                                        start * self.v_head_dim, h * self.v_head_dim)
        # The softmax scale is that of the decompressed heads (nope + rope dims), with
        # DeepSeek's YaRN correction; absorption changes the dot products' length, not value.
        scaling = qk_head_dim**-0.5 * yarn_softmax_scale(rope_parameters(config), trained_context)
        self.attn = PagedAttention(layer_id, h, 1, r + self.rope_dim, scaling, v_head_dim=r)
        # Set by process_weights_after_loading: w_uk (H, nope, R), w_uv (H, R, v).
        self.register_parameter("w_uk", None)
        self.register_parameter("w_uv", None)

    def process_weights_after_loading(self) -> None:
        """Splits ``kv_b_proj`` into the absorbed W_UK and W_UV and moves RoPE pairs to the
        rotate-half layout. Runs once, on the checkpoint's weights; ``kv_b_proj`` is dropped."""
        h, r = self.num_heads, self.kv_lora_rank
        with torch.no_grad():
            if self.rope_interleaved:
                q_weight = self.q_proj.weight if self.q_lora_rank is None else self.q_b_proj.weight
                per_head = q_weight.view(h, self.nope_dim + self.rope_dim, -1)
                for head in per_head:
                    deinterleave_rows(head, slice(self.nope_dim, None))
                rope_rows = slice(r, r + self.rope_dim)
                deinterleave_rows(self.kv_a_proj_with_mqa.weight, rope_rows)
                if self.kv_a_proj_with_mqa.bias is not None:
                    deinterleave_rows(self.kv_a_proj_with_mqa.bias, rope_rows)
            w_kv = self.kv_b_proj.weight.view(h, self.nope_dim + self.v_head_dim, r)
            w_uk, w_uv = w_kv.split([self.nope_dim, self.v_head_dim], dim=1)
            self.w_uk = nn.Parameter(w_uk.contiguous(), requires_grad=False)  # (H, nope, R)
            self.w_uv = nn.Parameter(
                w_uv.transpose(1, 2).contiguous(), requires_grad=False
            )  # (H, R, v)
        del self.kv_b_proj

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """rope: the (cos, sin) of each token's position; x: (T, hidden) -> (T, hidden)."""
        t, h, r = x.shape[0], self.num_heads, self.kv_lora_rank
        q_nope, q_rope = self.project_q(x).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([r, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)  # (T, R)
        q_rope = apply_rotary(q_rope, *rope)  # (T, H, rope)
        k_rope = apply_rotary(k_rope.unsqueeze(1), *rope)  # (T, 1, rope)
        # Absorb W_UK into the query, head by head: (H, T, nope) @ (H, nope, R).
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # (T, H, R)
        query = torch.cat([q_latent, q_rope], dim=-1)  # (T, H, R + rope)
        key = torch.cat([latent.unsqueeze(1), k_rope], dim=-1)  # (T, 1, R + rope)
        out_latent = self.attn(query, key, key[..., :r], forward_batch)  # (T, H, R)
        out = torch.bmm(out_latent.transpose(0, 1), self.w_uv)  # (H, T, v)
        return self.o_proj(out.transpose(0, 1).reshape(t, h * self.v_head_dim))

    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) -> q (T, H, nope + rope), through the q-LoRA bottleneck if any."""
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.num_heads, self.nope_dim + self.rope_dim)
