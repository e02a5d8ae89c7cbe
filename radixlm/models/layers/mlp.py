"""The gated feed-forward block of Llama-family models (SwiGLU, Shazeer 2020), and its GeGLU
form (Gemma: the gate through tanh-approximated GELU instead of SiLU)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.kernels.cpu_ops import fused_ops
from radixlm.models.layers import tensor_parallel
from radixlm.models.layers.linear import RowParallelLinear, StackedLinear

# The gate activations by their Hugging Face config names (``hidden_act``, Gemma's
# ``hidden_activation``).
GATE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up fused into one matmul; ``act`` is SiLU
    unless ``activation`` names another of ``GATE_ACTIVATIONS`` (only SiLU has the fused
    CPU paths). Under tensor parallelism each rank holds a slice of the intermediate
    dimension, and the ranks' parts are summed (unless ``reduce`` is False: then the caller
    sums them)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 reduce: bool = True, activation: str = "silu"):
        super().__init__()
        if activation not in GATE_ACTIVATIONS:
            raise ValueError(f"MLP activation {activation!r} is not supported; supported: "
                             f"{sorted(GATE_ACTIVATIONS)}")
        self.activation = activation
        tp = tensor_parallel.current()
        start, count = tp.part(intermediate_size, "MLP intermediate size")
        self.gate_up_proj = StackedLinear(
            hidden_size, {"gate": count, "up": count}, bias=bias,
            shard_starts={"gate": start, "up": start} if tp.size > 1 else None,
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp, start,
                                           count, reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        if self.activation != "silu":
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (T, I / tp) each
            return self.down_proj(GATE_ACTIVATIONS[self.activation](gate) * up)
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
