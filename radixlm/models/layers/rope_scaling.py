"""RoPE frequency scalings for contexts beyond the trained one, and YaRN's attention scale.

Each scaling maps (head_dim, base, the config's RoPE parameters) to the inverse frequencies
theta_i (i < head_dim / 2) and an ``attention_factor`` by which cos and sin are multiplied
(1.0 for every type but YaRN). ``dynamic`` depends on the serving context and is handled by
``RotaryEmbedding`` itself; ``linear`` divides positions rather than frequencies.

- ``llama3``: Llama 3.1's frequency bands (long wavelengths / factor, short kept).
- ``yarn`` (Peng et al. 2023, "YaRN"): NTK-by-parts interpolation between extrapolated
  (high-frequency) and interpolated (low-frequency) dims, with a linear ramp in between,
  and cos/sin scaled by 0.1 ln(factor) + 1. DeepSeek-V2/V3 write the same type with
  ``mscale`` and ``mscale_all_dim``: cos/sin are scaled by mscale(factor, mscale) /
  mscale(factor, mscale_all_dim), and the softmax scale is multiplied by
  mscale(factor, mscale_all_dim)^2 (``yarn_softmax_scale``). SGLang calls that variant
  ``deepseek_yarn``; both names are read here.
- ``longrope`` (Ding et al. 2024, "LongRoPE"; Phi-3 calls it ``su``): per-dim rescale factors,
  ``short_factor`` within the original context and ``long_factor`` beyond it, and cos/sin
  scaled by sqrt(1 + ln(factor) / ln(original context)).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def default_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    """theta_i = base^(-2i/d) for i < d/2."""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def llama3_inv_freq(head_dim: int, base: float, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by ``factor``, short ones kept, a smooth band between."""
    inv_freq = default_inv_freq(head_dim, base)
    factor = params["factor"]
    low_freq_factor = params.get("low_freq_factor", 1.0)
    high_freq_factor = params.get("high_freq_factor", 4.0)
    old_context = params.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 when not extending)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def yarn_factor(params: dict[str, Any], trained_context: int) -> float:
    """The context extension factor; DeepSeek configs may leave it to the context ratio."""
    factor = params.get("factor")
    if factor is None:
        return trained_context / yarn_original_context(params, trained_context)
    return float(factor)


def yarn_original_context(params: dict[str, Any], trained_context: int) -> int:
    return int(params.get("original_max_position_embeddings") or trained_context)


def yarn_inv_freq(
    head_dim: int, base: float, params: dict[str, Any], trained_context: int
) -> tuple[torch.Tensor, float]:
    """YaRN's NTK-by-parts frequencies and cos/sin factor: (inv_freq (head_dim / 2,), factor).

    Dims that rotate more than ``beta_fast`` times over the original context keep their
    frequency; those rotating fewer than ``beta_slow`` times are divided by ``factor``; the
    band between is a linear blend over the dim index.
    """
    factor = yarn_factor(params, trained_context)
    original = yarn_original_context(params, trained_context)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def dim_of_rotations(rotations: float) -> float:
        # The dim index whose wavelength fits ``rotations`` times into the original context.
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of_rotations(beta_fast), dim_of_rotations(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a step instead of a ramp, without dividing by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = default_inv_freq(head_dim, base)
    interpolated = extrapolated / factor
    inv_freq = interpolated * ramp + extrapolated * (1 - ramp)

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    return inv_freq, float(attention_factor)


def yarn_softmax_scale(params: dict[str, Any], trained_context: int) -> float:
    """The factor DeepSeek multiplies its softmax scale by: mscale(factor, mscale_all_dim)^2.

    1.0 without RoPE scaling or without ``mscale_all_dim`` (as transformers computes it,
    for any non-default RoPE type).
    """
    if params.get("rope_type", "default") == "default":
        return 1.0
    mscale_all_dim = params.get("mscale_all_dim")
    if not mscale_all_dim:
        return 1.0
    return yarn_mscale(yarn_factor(params, trained_context), mscale_all_dim) ** 2


def longrope_inv_freqs(
    head_dim: int, base: float, params: dict[str, Any], trained_context: int
) -> tuple[torch.Tensor, torch.Tensor, int, float]:
    """LongRoPE's (short inv_freq, long inv_freq (head_dim / 2,) each, the original context
    they switch at, the cos/sin factor), computed as transformers does: theta_i =
    1 / (factor_i * base^(2i/d)). ``factor`` defaults to the trained over the original context."""
    original = int(params.get("original_max_position_embeddings") or trained_context)
    factor = params.get("factor") or trained_context / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (math.sqrt(1 + math.log(factor) / math.log(original))
                            if factor > 1 else 1.0)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim

    def inv_freq(name: str) -> torch.Tensor:
        if not params.get(name):
            raise ValueError(f"rope_type longrope needs {name} (a list of {exponents.numel()} "
                             f"numbers) in the config's RoPE parameters")
        factors = torch.tensor(params[name], dtype=torch.float32)
        if factors.shape != exponents.shape:
            raise ValueError(f"rope {name} has {factors.numel()} entries; the rotated head "
                             f"dim {head_dim} needs {exponents.numel()}")
        return 1.0 / (factors * base**exponents)

    return inv_freq("short_factor"), inv_freq("long_factor"), original, float(attention_factor)
