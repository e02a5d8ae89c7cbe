"""RMSNorm (Zhang & Sennrich 2019), with the residual add folded in as Llama-style models use it,
and Gemma's variant (scale 1 + w, in float32).

On CPUs with the fused kernels on (``radixlm.kernels.cpu_ops.fused_ops``) each norm, with
its residual add, is one kernel call instead of a chain of torch operations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.kernels.cpu_ops import fused_ops


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: norm(x). With it: (norm(x + residual), x + residual)."""
        kernels = fused_ops.for_tensor(x)
        if (kernels is not None and x.dtype == self.weight.dtype
                and (residual is None or residual.dtype == x.dtype)):
            if residual is None:
                return kernels.rms_norm(x, self.weight, self.eps)
            return kernels.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op; it accumulates in float32 for half-precision inputs.
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: y = x / rms(x) * (1 + weight), computed in float32 and cast back.

    ``weight`` keeps Hugging Face's convention (stored as w, applied as 1 + w; zeros are
    the identity scale), so checkpoints load unchanged. Same call signature as ``RMSNorm``.
    With the fused kernels on, one kernel call takes the float32 scale 1 + w (kept while
    ``weight`` is unchanged: its tensor and version).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps
        self._scale: tuple[tuple, torch.Tensor] | None = None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: norm(x). With it: (norm(x + residual), x + residual), the sum
        in x's dtype."""
        kernels = fused_ops.for_tensor(x)
        if (kernels is not None and x.dtype == self.weight.dtype
                and (residual is None or residual.dtype == x.dtype)):
            if residual is None:
                return kernels.rms_norm(x, self.scale(), self.eps)
            return kernels.add_rms_norm(x, residual, self.scale(), self.eps)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def scale(self) -> torch.Tensor:
        """1 + weight in float32, (hidden,)."""
        weight = self.weight
        key = (weight.data_ptr(), weight._version, weight.device)
        if self._scale is None or self._scale[0] != key:
            self._scale = key, (1.0 + weight.detach().float()).contiguous()
        return self._scale[1]

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # (x * (1 + w)) rounds once, in float32, as Gemma's reference does (not x.to(dtype) * w).
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)
