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

    The angles are computed for a batch's positions when ``lookup`` is called (one product
    a position and frequency, bitwise what a table of every position would hold), once a
    batch and shared by all layers; no table of ``max_position`` positions is kept, so
    memory does not grow with the context a model serves (a table per layer kind of every
    position, cos and sin, in float32) and no host sync is needed to index one.

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
        self.attention_factor = 1.0
        self.position_divisor = float(params["factor"]) if rope_type == "linear" else None
        self.long_from: int | None = None  # positions from here on take ``long_inv_freq``
        long_freq = None
        if rope_type == "dynamic" and max_position > trained_context:
            factor = params["factor"]
            scaled_base = base * (
                (factor * max_position / trained_context) - (factor - 1)
            ) ** (head_dim / (head_dim - 2))
            inv_freq = default_inv_freq(head_dim, base)
            long_freq, self.long_from = default_inv_freq(head_dim, scaled_base), trained_context
        elif rope_type in ("longrope", "su"):
            inv_freq, long_freq, self.long_from, self.attention_factor = longrope_inv_freqs(
                head_dim, base, params, trained_context)
        elif rope_type == "llama3":
            inv_freq = llama3_inv_freq(head_dim, base, params)
        elif rope_type in ("yarn", "deepseek_yarn"):
            inv_freq, self.attention_factor = yarn_inv_freq(head_dim, base, params,
                                                            trained_context)
        else:
            inv_freq = default_inv_freq(head_dim, base)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)  # (D/2,)
        self.register_buffer("long_inv_freq", None if long_freq is None else long_freq.float(),
                             persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 (T, D/2) cos and sin of ``positions`` (T,) times each frequency (and the
        attention factor), on the positions' device."""
        at = positions.to(torch.float32)
        if self.position_divisor is not None:
            at = at / self.position_divisor
        angles = torch.outer(at, self.inv_freq)  # (T, D/2)
        if self.long_inv_freq is not None:
            late = (positions >= self.long_from).unsqueeze(1)
            angles = torch.where(late, torch.outer(at, self.long_inv_freq), angles)
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotation for ``positions`` (T,), computed once per batch and shared by all layers:
        (cos, signed sin), each (T, 1, D) in ``dtype``, for ``apply_rotary``."""
        cos, sin = self.cos_sin(positions)  # (T, D/2)
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
