"""Projection weights laid out once, after loading, in the blocked layout of the CPU's
bfloat16 matmul kernel (oneDNN's), or where the fused CPU kernels serve, in theirs.

torch hands a bfloat16 ``F.linear`` on a CPU to oneDNN, which reorders the (out, in) weight
into its blocked layout on every call. For the few rows of a decode step that reorder
costs more than the product: on the default model's projections (2 threads, an AMX CPU)
weights reordered once were faster at one row and at 64 rows, the head too, and as fast at
512 rows (figures in benchmarks/RESULTS.md). The
products come from the same kernels (bitwise equal to ``F.linear``'s at 1, 16 and 512 rows
there; at 64, oneDNN may block the sum differently: within one bfloat16 step). The routed
experts of MoE layers get the layout too, one weight per expert and projection: for
Mixtral-like experts scaled down (8 experts, hidden 1024, intermediate 2816) the gate/up
and the down products of an expert at one row are faster laid out too.

Where the runner's plan asks (``CpuExecutionPlan.keep_rows``: the fused CPU kernels on,
and ``disable_cpu_weight_rows`` not set), the kernels get copies of their own:

- Where the plan runs bfloat16 on the kernels' column pairs (``CpuExecutionPlan.pair_kernels``:
  AVX-512 BF16 and no AMX), each weight whose
  out features are a multiple of 16 and in features even is laid out by column pairs
  (``PairedWeight``) *instead of* oneDNN's layout, and every pass runs the kernels'
  ``pair_matmul``: on a 2-core Zen 4, all the default model's weights, 2 threads, it was
  faster than oneDNN from one row to 512, most at few rows. Its products of a row do not
  depend on the pass's other
  rows, so prompt passes keep the property ``CpuExecutionPlan.prompt_pass`` asks for. A gated
  MLP's gate_up weight also serves ``gated_matmul`` (``pair_matmul_silu``).
- Elsewhere, passes of up to ``FEW_ROWS`` rows (decode steps of small batches) run the
  kernels' ``dense_matmul`` over the plain (out, in) rows, which ask for the weights ahead
  of where they read (default model, all weights, an AMX CPU: faster than oneDNN at 1, 2
  and 4 rows, slower at 8). Those
  rows are kept beside the blocked copy, which doubles the projections' memory. Prompt
  passes stay on oneDNN whatever their rows (``CpuExecutionPlan.prompt_pass``): oneDNN's
  products do not depend on a pass's rows (bitwise equal at 1, 16 and 512), so the few new
  tokens of a prompt after a cache hit get the hidden states, and the KV, that a pass over
  the whole prompt computes for them. (The few-row kernel rounds its bfloat16 outputs from
  other sums; at a tie between bfloat16 logits, which the default model's answer to a chat
  question starts with, that was enough to change a greedy reply.)

Applies to bfloat16 models on CPUs whose torch has oneDNN with bfloat16 support, when no
weight-only format (``weight_formats.py``) packs the weights instead; float32 is left to
torch's own GEMM (a prepacked float32 weight was slower for one row).
Invariant: as for the weight-only formats, a layer's shapes, bias and interface do not
change; the layout is opaque, so nothing may read a laid-out layer's ``weight``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.kernels.cpu_ops import fused_ops
from radixlm.kernels.cpu_ops.execution_plan import CpuExecutionPlan
from radixlm.kernels.cpu_ops.fused_ops import ProjectionKernel
from radixlm.models.layers.column_layouts import (
    by_column_pairs,
    fits_column_pairs,
    from_column_pairs,
    gates_by_pairs,
)
from radixlm.models.layers.moe_experts import StackedExperts
from radixlm.models.layers.weight_formats import (
    FusedProjection,
    PackedWeight,
    pack_each_weight,
)

FEW_ROWS = 4  # the most rows a pass multiplies over kept rows


def uses_blocked_layout(device: torch.device | str, dtype: torch.dtype,
                        weight_format: str | None = None) -> bool:
    """True where the loader lays the weights out (``lay_out_for_cpu``): bfloat16 on a CPU
    with oneDNN's bfloat16, and no weight-only format packing them instead."""
    return (weight_format is None and torch.device(device).type == "cpu"
            and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@dataclass(eq=False)
class BlockedWeight(PackedWeight):
    """A bfloat16 (out, in) weight in oneDNN's blocked layout (an opaque tensor), and, where
    the plan keeps them, its plain rows for passes of up to ``FEW_ROWS`` rows, which the
    fused CPU kernels' ``dense_matmul`` multiplies faster where they are on (not in prompt
    passes: ``CpuExecutionPlan.prompt_pass``)."""

    weight: torch.Tensor  # (out, in), layout torch._mkldnn
    plan: CpuExecutionPlan
    rows: torch.Tensor | None = None  # (out, in) bfloat16, contiguous
    rows_hint = 1  # the batch size oneDNN picks the blocking for: decode's one row

    @classmethod
    def pack(cls, weight: torch.Tensor, plan: CpuExecutionPlan) -> BlockedWeight:
        weight = weight.detach()
        blocked = torch.ops.mkldnn._reorder_linear_weight(weight, cls.rows_hint)
        return cls(blocked, plan, weight.contiguous() if plan.keep_rows else None)

    def _few_rows(self, rows: int) -> bool:
        return self.rows is not None and rows <= FEW_ROWS and not self.plan.prompt_pass

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self._few_rows(x.shape[0]):
            kernels = fused_ops.for_tensor(x)
            if kernels is not None:
                return kernels.dense_matmul(x, self.rows)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")

    def fused_projection(self, rows: int, dtype: torch.dtype) -> FusedProjection | None:
        if self._few_rows(rows):
            return FusedProjection.of(ProjectionKernel.DENSE, self.rows)
        return None  # oneDNN's product: not one of the kernels'

    def dequantized(self) -> torch.Tensor:
        return self.weight.to_dense().float()

    def nbytes(self) -> int:
        rows = 0 if self.rows is None else self.rows.numel() * self.rows.element_size()
        return self.weight.numel() * self.weight.element_size() + rows


@dataclass(eq=False)
class PairedWeight(PackedWeight):
    """A bfloat16 (out, in) weight as (out / 16, in / 2, 16, 2): for each group of 16 out
    features and each pair of in features, the 16 features' two weights side by side, which
    the fused CPU kernels' ``pair_matmul`` multiplies (one 512-bit vector a dot-product
    instruction). It serves every pass, prompt or decode; a row's products do not depend on
    the other rows of its pass. Should the kernels be turned off after loading, passes fall
    back to torch's ``F.linear`` on the weight unpacked (correct, slow)."""

    pairs: torch.Tensor  # (out / 16, in / 2, 16, 2) bfloat16, contiguous

    fits = staticmethod(fits_column_pairs)

    @classmethod
    def pack(cls, weight: torch.Tensor) -> PairedWeight:
        return cls(by_column_pairs(weight.detach()))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        kernels = fused_ops.for_tensor(x)
        if kernels is not None:
            return kernels.pair_matmul(x, self.pairs)
        return F.linear(x, self._plain())

    def gated_matmul(self, x: torch.Tensor) -> torch.Tensor | None:
        kernels = fused_ops.for_tensor(x)
        if kernels is None or x.dtype != torch.bfloat16 or not gates_by_pairs(self.pairs):
            return None
        return kernels.pair_matmul_silu(x, self.pairs)

    def fused_projection(self, rows: int, dtype: torch.dtype) -> FusedProjection | None:
        return FusedProjection.of(ProjectionKernel.PAIRS, self.pairs)

    def _plain(self) -> torch.Tensor:
        return from_column_pairs(self.pairs)

    def dequantized(self) -> torch.Tensor:
        return self._plain().float()

    def nbytes(self) -> int:
        return self.pairs.numel() * self.pairs.element_size()


def lay_out_for_cpu(model: nn.Module, plan: CpuExecutionPlan) -> int:
    """Reorders the projections' and the output head's bfloat16 weights into oneDNN's
    layout, and the MoE layers' routed experts too (``uses_blocked_layout`` must hold);
    where ``plan.keep_rows``, the fused kernels get their own copies: column pairs instead
    of oneDNN's layout where the plan runs them (``plan.pair_kernels``) and the weight fits
    (``PairedWeight``), else plain rows beside it for few-row passes (``BlockedWeight``).
    Returns their bytes (a tied head's rows are the embedding's own, counted once more)."""
    experts = [m for m in model.modules() if isinstance(m, StackedExperts)]
    pack = functools.partial(_pack, plan=plan)
    return pack_each_weight(model, pack) + sum(
        module.pack_expert_weights(pack) for module in experts)


def _pack(weight: torch.Tensor, plan: CpuExecutionPlan) -> PackedWeight:
    if plan.keep_rows and plan.pair_kernels and PairedWeight.fits(weight):
        return PairedWeight.pack(weight)
    return BlockedWeight.pack(weight, plan)
