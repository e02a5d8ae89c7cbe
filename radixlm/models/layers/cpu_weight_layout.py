"""Projection weights laid out once, after loading, in the blocked layout of the CPU's
bfloat16 matmul kernel (oneDNN's).

torch hands a bfloat16 ``F.linear`` on a CPU to oneDNN, which reorders the (out, in) weight
into its blocked layout on every call. For the few rows of a decode step that reorder
costs more than the product: on the default model's projections (2 threads, an AMX CPU)
one row took 19.8 ms for all of them through ``F.linear`` and 11.9 ms with weights
reordered once; the head 2.5 vs 1.2 ms; 64 rows 26.0 vs 17.6 ms; 512 rows the same. The
products come from the same kernels (bitwise equal to ``F.linear``'s at 1, 16 and 512 rows
there; at 64, oneDNN may block the sum differently: within one bfloat16 step). The routed
experts of MoE layers get the layout too, one weight per expert and projection: for
Mixtral-like experts scaled down (8 experts, hidden 1024, intermediate 2816) the gate/up
products take 0.63 instead of 1.05 ms an expert at one row, the down products 0.16
instead of 0.23.

Applies to bfloat16 models on CPUs whose torch has oneDNN with bfloat16 support, when no
weight-only format (``weight_formats.py``) packs the weights instead; float32 is left to
torch's own GEMM (a prepacked float32 weight was slower for one row: 25.7 vs 15.8 ms).
Invariant: as for the weight-only formats, a layer's shapes, bias and interface do not
change; the layout is opaque, so nothing may read a laid-out layer's ``weight``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from radixlm.models.layers.moe_experts import StackedExperts
from radixlm.models.layers.weight_formats import PackedWeight, pack_each_weight


def uses_blocked_layout(device: torch.device | str, dtype: torch.dtype,
                        weight_format: str | None = None) -> bool:
    """True where the loader lays the weights out (``lay_out_for_cpu``): bfloat16 on a CPU
    with oneDNN's bfloat16, and no weight-only format packing them instead."""
    return (weight_format is None and torch.device(device).type == "cpu"
            and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@dataclass(eq=False)
class BlockedWeight(PackedWeight):
    """A bfloat16 (out, in) weight in oneDNN's blocked layout (an opaque tensor)."""

    weight: torch.Tensor  # (out, in), layout torch._mkldnn
    rows_hint = 1  # the batch size oneDNN picks the blocking for: decode's one row

    @classmethod
    def pack(cls, weight: torch.Tensor) -> BlockedWeight:
        return cls(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), cls.rows_hint))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")

    def dequantized(self) -> torch.Tensor:
        return self.weight.to_dense().float()

    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


def lay_out_for_cpu(model: nn.Module) -> int:
    """Reorders the projections' and the output head's bfloat16 weights into oneDNN's
    layout, and the MoE layers' routed experts too (``uses_blocked_layout`` must hold);
    returns their bytes."""
    experts = [m for m in model.modules() if isinstance(m, StackedExperts)]
    return pack_each_weight(model, BlockedWeight.pack) + sum(
        module.pack_expert_weights(BlockedWeight.pack) for module in experts)
