"""Rotary position embeddings (RoFormer, Su et al. 2021) and their context-length scalings.

Supported ``rope_type`` values: ``default``, ``linear`` (position interpolation, Chen et al.
2023), ``dynamic`` (dynamic NTK-aware scaling), ``llama3`` (Llama 3.1's frequency-banded
scaling), ``yarn`` and ``deepseek_yarn`` (YaRN, with DeepSeek's mscale correction),
``longrope`` / ``su`` (Phi-3's LongRoPE); the frequencies of each are in ``rope_scaling``.
The rotation uses the "rotate half" layout of Hugging Face Llama checkpoints: the first and
second halves of each head are the two coordinates of each rotated pair.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from radixlm.kernels.cpu_ops import fused_ops
from radixlm.models.layers.rope_scaling import (
    default_inv_freq,
    llama3_inv_freq,
    longrope_inv_freqs,
    yarn_inv_freq,
)

SUPPORTED_ROPE_TYPES = (
    "default", "linear", "dynamic", "llama3", "yarn", "deepseek_yarn", "longrope", "su")


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query and key heads at given positions.

    cos/sin are tabulated once for ``max_position`` positions; ``forward`` indexes them, so
    a batch of ragged sequences costs one gather.

    ``dynamic`` scaling: positions below the model's ``max_position_embeddings`` use the
    unscaled frequencies (exactly what transformers computes for such sequences); beyond
    it, the NTK-scaled base for the full serving context is used. Keeping the frequencies
    fixed per position (instead of per sequence length) keeps cached keys valid.

    ``longrope``: positions below the original context use the short factors, those beyond
    it the long ones. transformers instead picks one set per forward pass by the sequence's
    length, so the two agree exactly for sequences within the original context; beyond it
    a per-position choice keeps cached keys valid, as ``dynamic`` does here.

    ``yarn``: cos and sin are multiplied by YaRN's ``attention_factor`` (so the rotated q and
    k each carry it, as in transformers); ``self.attention_factor`` records it.
    """

    def __init__(
        self, head_dim: int, max_position: int, params: dict[str, Any], trained_context: int
    ):
        super().__init__()
        rope_type = params.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
            )
        base = float(params.get("rope_theta", 10000.0))
        self.head_dim = head_dim
        positions = torch.arange(max_position, dtype=torch.float32)
        self.attention_factor = 1.0
        if rope_type == "dynamic" and max_position > trained_context:
            factor = params["factor"]
            scaled_base = base * (
                (factor * max_position / trained_context) - (factor - 1)
            ) ** (head_dim / (head_dim - 2))
            short = torch.outer(positions[:trained_context], default_inv_freq(head_dim, base))
            long = torch.outer(positions[trained_context:], default_inv_freq(head_dim, scaled_base))
            angles = torch.cat([short, long])
        elif rope_type in ("longrope", "su"):
            short_freq, long_freq, original, self.attention_factor = longrope_inv_freqs(
                head_dim, base, params, trained_context)
            angles = torch.cat([torch.outer(positions[:original], short_freq),
                                torch.outer(positions[original:], long_freq)])
        else:
            if rope_type == "llama3":
                inv_freq = llama3_inv_freq(head_dim, base, params)
            elif rope_type in ("yarn", "deepseek_yarn"):
                inv_freq, self.attention_factor = yarn_inv_freq(
                    head_dim, base, params, trained_context
                )
            else:
                inv_freq = default_inv_freq(head_dim, base)
            if rope_type == "linear":
                positions = positions / params["factor"]
            angles = torch.outer(positions, inv_freq)  # (max_position, head_dim / 2)
        self.register_buffer("cos", angles.cos() * self.attention_factor, persistent=False)
        self.register_buffer("sin", angles.sin() * self.attention_factor, persistent=False)

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotation for ``positions`` (T,), computed once per batch and shared by all layers:
        (cos, signed sin), each (T, 1, D) in ``dtype``, for ``apply_rotary``."""
        cos = self.cos.index_select(0, positions)  # (T, D/2)
        sin = self.sin.index_select(0, positions)
        cos_full = torch.cat([cos, cos], dim=-1).unsqueeze(1).to(dtype)
        signed_sin = torch.cat([-sin, sin], dim=-1).unsqueeze(1).to(dtype)
        return cos_full, signed_sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotates each (first-half, second-half) pair of x (T, H, D) by its position's angle:
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), as three fused elementwise ops (one
    kernel on CPUs with the fused kernels on)."""
    kernels = fused_ops.for_tensor(x)
    if kernels is not None and x.dim() == 3 and x.dtype == cos.dtype and x.stride(-1) == 1:
        return kernels.rotary(x, cos, signed_sin)
    swapped = torch.roll(x, x.shape[-1] // 2, dims=-1)  # (x2, x1)
    return torch.addcmul(x * cos, swapped, signed_sin)
