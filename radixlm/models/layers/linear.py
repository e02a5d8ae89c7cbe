"""Linear layers split across tensor-parallel ranks, and fused from several checkpoint tensors.

Fusing q/k/v (and gate/up) into one matmul saves a kernel launch and a read of the input
per layer. The checkpoint keeps them apart, so each stacked layer knows where each named
shard goes and loads it there. Under tensor parallelism (``tensor_parallel``) a stacked
layer is column-parallel: each rank holds a slice of every shard's rows; ``RowParallelLinear``
holds the matching slice of the next projection's columns and sums the partial outputs.
After loading, a weight-only format (``weight_formats.py``) may replace a layer's weight
with a packed one; the layer then multiplies through it. An unpacked layer multiplies
through ``weight_formats.plain_matmul`` (``F.linear``, or on CPUs the fused kernels for
float32 passes of a few rows). Every layer holds the model's CPU plan (``plan``, set by the
loader: ``kernels/cpu_ops/execution_plan.py``), which says which kernel multiplies what.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixlm.kernels.cpu_ops.execution_plan import TORCH_CHOICES, CpuExecutionPlan
from radixlm.models.layers.compiled_ops import packed_matmul
from radixlm.models.layers.tensor_parallel import TensorParallel
from radixlm.models.layers.weight_formats import (
    FusedProjection,
    PackedWeight,
    plain_fused_projection,
    plain_matmul,
)

if TYPE_CHECKING:
    from radixlm.models.lora.lora_layers import LoraProjection

_packed_keys = itertools.count()


class Linear(nn.Linear):
    """``nn.Linear`` whose weight may be packed after loading (then ``weight`` is None and
    ``packed`` holds it)."""

    packed: PackedWeight | None = None
    packed_key: int = -1
    """The packed weight's key in a compiled pass's table (``compiled_ops.compiled_pass``)."""
    plan: CpuExecutionPlan = TORCH_CHOICES
    """The model's CPU plan (the loader sets it; a packed weight got it when packed)."""
    lora: LoraProjection | None = None
    """Its LoRA adapters' weights, where the server adapts it (``models/lora``): their
    terms are added to its output for the rows of a batch that use an adapter."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, in) -> (T, out)."""
        if self.packed is None:
            y = plain_matmul(x, self.weight, self.bias, self.plan.float32_fused_rows)
        else:
            y = self.project(x)
            y = y if self.bias is None else y + self.bias
        if self.lora is not None:
            self.lora.add(x, y)
        return y

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, in) -> x @ weight.T (T, out), without the bias."""
        if self.packed is None:
            return plain_matmul(x, self.weight, fused_rows=self.plan.float32_fused_rows)
        if torch.compiler.is_compiling():
            return packed_matmul(x, self.packed_key, self.out_features)
        return self.packed.matmul(x)

    def fused_projection(self, rows: int, dtype: torch.dtype) -> FusedProjection | None:
        """The kernel and operands through which ``project`` multiplies ``rows`` rows of
        ``dtype`` while the fused CPU kernels are on (for their ``decode_layer``), or None
        where it takes a path that one does not have (``PackedWeight.fused_projection``)."""
        if self.packed is None:
            return plain_fused_projection(self.weight, rows, dtype,
                                          self.plan.float32_fused_rows)
        return self.packed.fused_projection(rows, dtype)

    def pack_weight(self, packer) -> int:
        """Replaces the weight by ``packer(weight)`` (a ``PackedWeight``); returns its bytes."""
        return self.take_packed(packer(self.weight.detach()))

    def take_packed(self, packed: PackedWeight) -> int:
        """Holds ``packed`` (a (out_features, in_features) weight: a checkpoint's own
        format, e.g. GGUF blocks) instead of the weight; returns its bytes."""
        self.packed = packed
        self.packed_key = next(_packed_keys)
        self.weight = None
        return packed.nbytes()


class StackedLinear(Linear):
    """``nn.Linear`` whose output rows are the concatenation of named shards.

    ``shard_sizes`` maps a shard name (e.g. "q", "k", "v") to its number of output rows
    here, in the order they are stacked; ``shard_starts`` maps it to the first row of the
    checkpoint tensor those rows are (0 for all: the whole tensor, as without parallelism).
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool,
                 shard_starts: dict[str, int] | None = None):
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        self.shard_starts = shard_starts or {}
        self.shard_totals: dict[str, int] = {}
        """Each shard's rows in the checkpoint, as loaded (more than here under tensor
        parallelism)."""
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size

    def silu_gated_project(self, x: torch.Tensor) -> torch.Tensor | None:
        """For a layer stacking a gated MLP's gate over its up (equal shards, no bias): x (T,
        in) -> silu(x @ gate.T) * (x @ up.T) (T, out / 2) from one kernel call where the
        packed weight has one (``PackedWeight.gated_matmul``), else None (the caller
        projects, then applies SiLU and the product). Not while torch.compile traces."""
        if (self.packed is None or self.bias is not None or x.dim() != 2
                or torch.compiler.is_compiling()
                or (self.lora is not None and self.lora.state.batch is not None)):
            return None
        return self.packed.gated_matmul(x)

    def load_shard(self, shard: str, param_name: str, tensor: torch.Tensor) -> None:
        """Copies this layer's rows of checkpoint tensor ``tensor`` into the rows of
        ``shard`` of ``param_name``."""
        offset, size = self.shard_offsets[shard]
        start = self.shard_starts.get(shard, 0)
        target = getattr(self, param_name)
        whole = not self.shard_starts  # (else: this rank's rows of a longer tensor)
        fits = tensor.shape[0] == size if whole else tensor.shape[0] >= start + size
        if not fits or tensor.shape[1:] != target.shape[1:]:
            raise ValueError(
                f"shard {shard!r} of {param_name}: expected {(size, *target.shape[1:])}"
                f"{'' if whole else ' (of more rows)'}, got {tuple(tensor.shape)}"
            )
        with torch.no_grad():
            target[offset : offset + size].copy_(tensor[start : start + size])
        self.shard_totals[shard] = tensor.shape[0]


class ColumnParallelLinear(Linear):
    """A (out, in) projection of which this rank holds output rows [out_start, out_start +
    out_count) (and their bias): its output is this rank's share, e.g. its heads. With one
    rank it is ``nn.Linear``."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 out_start: int = 0, out_count: int | None = None):
        out_count = out_features if out_count is None else out_count
        super().__init__(in_features, out_count, bias=bias)
        self.out_start, self.out_features_total = out_start, out_features

    def load_weight(self, param_name: str, tensor: torch.Tensor) -> None:
        """Copies this rank's rows of the checkpoint's ``param_name``."""
        target = getattr(self, param_name)
        full = (self.out_features_total, *target.shape[1:])
        if tensor.shape != full:
            raise ValueError(f"{param_name}: expected {full}, got {tuple(tensor.shape)}")
        with torch.no_grad():
            target.copy_(tensor[self.out_start : self.out_start + target.shape[0]])


class RowParallelLinear(Linear):
    """A (out, in) projection of which this rank holds input columns [in_start, in_start +
    in_count): its partial output is summed over the ranks, then the bias (held whole) is
    added once. With one rank it is ``nn.Linear``.

    ``reduce`` False leaves the sum to the caller (who adds more partial outputs to it
    first): the output is then this rank's part, rank 0's with the bias."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 tp: TensorParallel, in_start: int = 0, in_count: int | None = None,
                 reduce: bool = True):
        in_count = in_features if in_count is None else in_count
        super().__init__(in_count, out_features, bias=bias)
        self.tp, self.in_start, self.in_features_total = tp, in_start, in_features
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, in_count) -> (T, out), the same on every rank (unless not ``reduce``)."""
        if self.tp.size == 1:
            return super().forward(x)
        y = self.project(x)
        if self.lora is not None:  # (each rank adds its columns' share: the sum adds them up)
            self.lora.add(x, y)
        if self.reduce:
            y = self.tp.all_reduce(y)
        elif self.tp.rank != 0:
            return y
        return y if self.bias is None else y + self.bias

    def load_weight(self, param_name: str, tensor: torch.Tensor) -> None:
        """Copies this rank's columns of the checkpoint's ``param_name`` (the bias whole)."""
        target = getattr(self, param_name)
        if param_name == "weight":
            full = (target.shape[0], self.in_features_total)
            if tensor.shape != full:
                raise ValueError(f"{param_name}: expected {full}, got {tuple(tensor.shape)}")
            tensor = tensor[:, self.in_start : self.in_start + target.shape[1]]
        elif tensor.shape != target.shape:
            raise ValueError(f"{param_name}: expected {tuple(target.shape)}, "
                             f"got {tuple(tensor.shape)}")
        with torch.no_grad():
            target.copy_(tensor)
