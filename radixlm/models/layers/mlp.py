"""The gated feed-forward block of Llama-family models (SwiGLU, Shazeer 2020)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.kernels.cpu_ops import fused_ops
from radixlm.models.layers import tensor_parallel
from radixlm.models.layers.linear import RowParallelLinear, StackedLinear


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one matmul. Under tensor
    parallelism each rank holds a slice of the intermediate dimension, and the ranks' parts
    are summed (unless ``reduce`` is False: then the caller sums them)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 reduce: bool = True):
        super().__init__()
        tp = tensor_parallel.current()
        start, count = tp.part(intermediate_size, "MLP intermediate size")
        self.gate_up_proj = StackedLinear(
            hidden_size, {"gate": count, "up": count}, bias=bias,
            shard_starts={"gate": start, "up": start} if tp.size > 1 else None,
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp, start,
                                           count, reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gated = self.gate_up_proj.silu_gated_project(x)  # (T, I / tp), or None
        if gated is None:
            gated = silu_and_mul(self.gate_up_proj(x))
        return self.down_proj(gated)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2 I) gate | up -> silu(gate) * up (T, I); one kernel on CPUs with the fused
    kernels on (``radixlm.kernels.cpu_ops.fused_ops``)."""
    kernels = fused_ops.for_tensor(gate_up)
    if kernels is not None and gate_up.stride(-1) == 1:
        return kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)  # (T, I) each
    return F.silu(gate) * up
