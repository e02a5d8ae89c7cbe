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

Passes of up to ``FEW_ROWS`` rows (decode steps of small batches) are faster still on the
fused CPU kernels' ``dense_matmul`` over the plain (out, in) rows, which ask for the weights
ahead of where they read (default model, one row, all weights: 13.3 ms against oneDNN's
16.1; 2 rows 14.7 vs 16.1, 4 rows 15.4 vs 16.1, 8 rows 22.2 vs 16.4). Those rows are kept
beside the blocked copy where the runner asks (``keep_rows``: the fused kernels on, and
``disable_cpu_weight_rows`` not set), which doubles the projections' memory. Prompt passes
stay on oneDNN whatever their rows (``row_invariant_products``).

Applies to bfloat16 models on CPUs whose torch has oneDNN with bfloat16 support, when no
weight-only format (``weight_formats.py``) packs the weights instead; float32 is left to
torch's own GEMM (a prepacked float32 weight was slower for one row: 25.7 vs 15.8 ms).
Invariant: as for the weight-only formats, a layer's shapes, bias and interface do not
change; the layout is opaque, so nothing may read a laid-out layer's ``weight``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from radixlm.kernels.cpu_ops import fused_ops
from radixlm.models.layers.moe_experts import StackedExperts
from radixlm.models.layers.weight_formats import PackedWeight, pack_each_weight

FEW_ROWS = 4  # the most rows a pass multiplies over kept rows
_few_row_kernels = True  # False inside row_invariant_products()


def uses_blocked_layout(device: torch.device | str, dtype: torch.dtype,
                        weight_format: str | None = None) -> bool:
    """True where the loader lays the weights out (``lay_out_for_cpu``): bfloat16 on a CPU
    with oneDNN's bfloat16, and no weight-only format packing them instead."""
    return (weight_format is None and torch.device(device).type == "cpu"
            and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@dataclass(eq=False)
class BlockedWeight(PackedWeight):
    """A bfloat16 (out, in) weight in oneDNN's blocked layout (an opaque tensor), and
    optionally its plain rows for passes of up to ``FEW_ROWS`` rows, which the fused CPU
    kernels' ``dense_matmul`` multiplies faster where they are on (outside
    ``row_invariant_products``: not in prompt passes)."""

    weight: torch.Tensor  # (out, in), layout torch._mkldnn
    rows: torch.Tensor | None = None  # (out, in) bfloat16, contiguous
    rows_hint = 1  # the batch size oneDNN picks the blocking for: decode's one row

    @classmethod
    def pack(cls, weight: torch.Tensor, keep_rows: bool = False) -> BlockedWeight:
        weight = weight.detach()
        blocked = torch.ops.mkldnn._reorder_linear_weight(weight, cls.rows_hint)
        return cls(blocked, weight.contiguous() if keep_rows else None)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows is not None and x.shape[0] <= FEW_ROWS and _few_row_kernels:
            kernels = fused_ops.for_tensor(x)
            if kernels is not None:
                return kernels.dense_matmul(x, self.rows)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")

    def dequantized(self) -> torch.Tensor:
        return self.weight.to_dense().float()

    def nbytes(self) -> int:
        rows = 0 if self.rows is None else self.rows.numel() * self.rows.element_size()
        return self.weight.numel() * self.weight.element_size() + rows


@contextlib.contextmanager
def row_invariant_products(active: bool = True) -> Iterator[None]:
    """While ``active``, passes over laid-out weights all run on oneDNN, whose products do
    not depend on a pass's number of rows (bitwise equal at 1, 16 and 512), so the few new
    tokens of a prompt after a cache hit get the hidden states, and the KV, that a pass over
    the whole prompt computes for them: the runner runs prompt (extend) passes so. (The
    few-row kernel rounds its bfloat16 outputs from other sums; at a tie between bfloat16
    logits, which the default model's answer to a chat question starts with, that was enough
    to change a greedy reply.) Process-wide: forward passes must not overlap."""
    global _few_row_kernels
    before = _few_row_kernels
    _few_row_kernels = before and not active
    try:
        yield
    finally:
        _few_row_kernels = before


def lay_out_for_cpu(model: nn.Module, keep_rows: bool = False) -> int:
    """Reorders the projections' and the output head's bfloat16 weights into oneDNN's
    layout, and the MoE layers' routed experts too (``uses_blocked_layout`` must hold);
    ``keep_rows``: each keeps its plain weight too, for few-row passes (``BlockedWeight``).
    Returns their bytes (a tied head's rows are the embedding's own, counted once more)."""
    experts = [m for m in model.modules() if isinstance(m, StackedExperts)]
    pack = functools.partial(BlockedWeight.pack, keep_rows=keep_rows)
    return pack_each_weight(model, pack) + sum(
        module.pack_expert_weights(pack) for module in experts)
