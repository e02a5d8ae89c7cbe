"""Weight-only formats: the projections' weights stored in fewer bytes, computed in the
serving dtype.

A decode step of a small batch reads every weight once and does little arithmetic with
each, so on a CPU its time is the weights' bytes over the memory bandwidth. A format packs
the weight of each projection (``linear.Linear``) and of the output head
(``VocabParallelEmbedding.logits``; the embedding lookup keeps its own rows) after loading:

- ``fp16wo``: IEEE half (2 bytes a weight). Passes of up to ``half_fused_max_rows`` rows
  run the fused CPU kernels' ``dense_matmul`` where they are on (activations as stored,
  float32 sums; with float32 activations about twice as fast as torch's kernel at one row
  and at 16). Without them, passes of up to
  ``HALF_GEMV_MAX_ROWS`` rows (small-batch decode) run torch's half matrix-vector kernel
  row by row: the row is rounded to half, the products summed in float32 (what llama.cpp's
  F16 path does; an activation beyond half's range, 65504, would overflow there). Larger
  passes convert the weight into a reused buffer in the serving dtype and multiply there.
  That is ``HalfWeight``, for 16-bit serving dtypes: served in float32 on a CPU, the loader
  stores ``fp16wo`` as ``dtype=auto`` stores weights (``weight_storage.py``), all in float16,
  column blocks where they fit (faster at every pass length).
- ``int8wo``: symmetric int8 with one float scale per output row (1 byte a weight). In
  bfloat16 on CPUs where the kernels' ``pair_matmul`` serves, the integers are laid out by
  column pairs and every pass runs ``int8_pair_matmul`` (``Int8Weight``); in float32 on
  the fused kernels, in column blocks where they fit, every pass on ``blocked_int8_matmul``
  (the loader asks for either layout). Elsewhere, passes
  of up to ``int8_kernel_max_rows`` rows run the fused CPU kernels' ``int8_matmul`` where
  they are on (activations as stored, float32 sums; faster than torch's kernel at one row
  and at 16), else torch's int8
  weight-only kernel (inside it the activations are bfloat16, the sums float32); larger
  passes widen the integers into the buffer, multiply, and scale the product's columns.

The row limits of torch's kernels are where the measured costs cross on 2-core AVX2,
AVX-512 and AMX CPUs (the kernels' cost grows with the rows, the conversion's does not);
the fused kernels' were measured on the AMX CPU (still faster at 32 rows over float16
weights, in float32 and in bfloat16; int8 passes keep torch's kernel's limits, below which
the fused one was faster at every size) and, for float32 activations over half weights, on
2-core AVX2 (``HALF_FUSED_MAX_ROWS_FLOAT32``). Figures in benchmarks/RESULTS.md. Outputs
come back in the serving dtype.
Invariant: packing changes which bytes a layer reads, never its shapes, its bias or the
model's interface; the buffer is shared by one model's layers, so forward passes of one
model must not run concurrently (the scheduler runs them one at a time).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.kernels.cpu_ops import fused_ops
from radixlm.kernels.cpu_ops.execution_plan import FLOAT32_FUSED_ROWS
from radixlm.kernels.cpu_ops.fused_ops import ProjectionKernel
from radixlm.models.layers.column_layouts import (
    by_column_blocks,
    by_column_pairs,
    fits_column_blocks,
    fits_column_pairs,
    from_column_blocks,
    from_column_pairs,
    gates_by_pairs,
)

HALF_GEMV_MAX_ROWS = 4
HALF_FUSED_MAX_ROWS = 32
"""Rows of 16-bit activations up to which half weights run ``dense_matmul`` (measured on
the AMX CPU, where oneDNN's 16-bit GEMM takes larger passes)."""
HALF_FUSED_MAX_ROWS_FLOAT32 = 160
"""Rows of float32 activations up to which they do. The kernel keeps 130-150 GFLOP/s from 16
rows on; torch's GEMM does more, but only after the weight is widened, and widening all of
a model's weights costs a pass the time to write them out in float32. On 2-core AVX2
(Zen 3), 2 threads, the default model's prompt passes at runner level (caches evicted
between passes as a decode step would) were faster on the kernel up to 160 tokens and
slower from 192; decode steps of 33-64 requests, which widened every weight at the former
limit of 32 rows, and the output head at 64 and 128 rows, faster. Figures in
benchmarks/RESULTS.md."""
INT8_KERNEL_MAX_ROWS = 32
INT8_KERNEL_MAX_ROWS_BF16 = 16
INT8_FUSED_MAX_ROWS_FLOAT32 = 128
"""Rows of float32 activations up to which int8 weights run the fused kernels'
``int8_matmul`` (torch's int8 kernel, where they are off, keeps ``INT8_KERNEL_MAX_ROWS``).
As for half weights (``HALF_FUSED_MAX_ROWS_FLOAT32``), the alternative widens every weight
for torch's GEMM. On 2-core AVX2 (Zen 3), 2 threads, ``int8wo``, the default model at
runner level: decode steps of 33-64 requests ran much faster than widened (the former limit
of 32 rows widened them); prompt passes (caches evicted between them) were faster up to 128
tokens, even at 160 and 192, slower at 256. Figures in benchmarks/RESULTS.md."""
WEIGHT_FORMATS = ("fp16wo", "int8wo")


def half_fused_max_rows(dtype: torch.dtype) -> int:
    """The most rows of ``dtype`` activations a pass over half weights runs on the fused
    kernels' ``dense_matmul`` (larger ones widen the weight for torch's GEMM)."""
    return HALF_FUSED_MAX_ROWS_FLOAT32 if dtype == torch.float32 else HALF_FUSED_MAX_ROWS


def plain_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 fused_rows: range = FLOAT32_FUSED_ROWS) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for an unpacked weight, x (T, in): float32 passes of
    ``fused_rows`` rows (the layer's plan's ``float32_fused_rows``) on a CPU run the fused
    kernels' ``dense_matmul`` where they are on, else ``F.linear``. torch's float32 GEMM is
    slow for 3-16 rows; at one and two rows which is faster differs between CPUs, so the
    runner measures it (``execution_plan``). Figures in benchmarks/RESULTS.md."""
    kernels = fused_ops.for_tensor(x)  # (None while torch.compile traces: reads no shape)
    if (kernels is None and torch.compiler.is_compiling() and fused_ops.active() is not None
            and x.device.type == "cpu"):
        out = kernel_matmul(x, weight, fused_rows.start)  # (the kernels decide when it runs)
        return out if bias is None else out + bias
    if (kernels is not None and x.dtype == torch.float32 and x.dim() == 2
            and x.shape[0] in fused_rows
            and weight.dtype == torch.float32 and weight.is_contiguous()):
        out = kernels.dense_matmul(x, weight)
        return out if bias is None else out.add_(bias)
    return F.linear(x, weight, bias)


@torch.library.custom_op("radixlm::kernel_matmul", mutates_args=())
def kernel_matmul(x: torch.Tensor, weight: torch.Tensor, first_fused_row: int) -> torch.Tensor:
    """``plain_matmul(x, weight)`` with float32 passes of ``first_fused_row`` to 16 rows on
    the kernels, as one operator a graph traced by torch.compile holds as a call
    (``compiled_ops.py``): x (T, in), weight (out, in) -> (T, out), contiguous."""
    fused_rows = range(first_fused_row, FLOAT32_FUSED_ROWS.stop)
    return plain_matmul(x, weight, fused_rows=fused_rows).contiguous()


@kernel_matmul.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, first_fused_row: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


class FusedProjection(NamedTuple):
    """A projection as the fused kernels' ``decode_layer`` multiplies it: the kernel, the
    weight in that kernel's layout, and the int8 scales (else an empty tensor). A GGUF
    projection (``ProjectionKernel.GGUF``) has an empty weight, its parts' blocks in
    ``parts``, and as scales an int64 (parts, 2) table of each part's ggml type and index in
    ``parts`` (``decode_layer`` takes every projection's parts in one list: see
    ``cpu_decode_layer.append_products``)."""

    kernel: ProjectionKernel
    weight: torch.Tensor
    scales: torch.Tensor
    parts: tuple[torch.Tensor, ...] = ()

    @classmethod
    def of(cls, kernel: ProjectionKernel, weight: torch.Tensor,
           scales: torch.Tensor | None = None) -> FusedProjection:
        return cls(kernel, weight, weight.new_empty(0) if scales is None else scales)

    @classmethod
    def gguf(cls, blocks: Sequence[torch.Tensor], types: Sequence[int]) -> FusedProjection:
        """The GGUF projection of parts ``blocks`` (uint8, in output order) of ``types``."""
        table = torch.tensor([[int(t), i] for i, t in enumerate(types)], dtype=torch.int64)
        return cls(ProjectionKernel.GGUF, blocks[0].new_empty(0), table, tuple(blocks))


def plain_fused_projection(weight: torch.Tensor, rows: int, dtype: torch.dtype,
                           fused_rows: range) -> FusedProjection:
    """What ``plain_matmul`` runs for ``rows`` rows of ``dtype`` with the kernels on."""
    if (dtype == torch.float32 and rows in fused_rows
            and weight.dtype == torch.float32 and weight.is_contiguous()):
        return FusedProjection.of(ProjectionKernel.DENSE, weight)
    return FusedProjection.of(ProjectionKernel.TORCH_LINEAR, weight)


def int8_kernel_max_rows(dtype: torch.dtype, fused: bool) -> int:
    """The most rows a pass in ``dtype`` runs on an int8 kernel: the fused kernels' where
    ``fused``, else torch's. A bfloat16 serving dtype means a CPU with native bfloat16
    (``dtype=auto`` picks it only there), whose widened bfloat16 product is cheap enough to
    win from 17 rows on (2-core AMX CPU; benchmarks/RESULTS.md);
    in float32 torch's kernel wins up to 32 rows, the fused one up to
    ``INT8_FUSED_MAX_ROWS_FLOAT32``."""
    if dtype == torch.bfloat16:
        return INT8_KERNEL_MAX_ROWS_BF16
    if fused and dtype == torch.float32:
        return INT8_FUSED_MAX_ROWS_FLOAT32
    return INT8_KERNEL_MAX_ROWS


class ConversionBuffer:
    """Reused storage a packed weight is widened into for a large pass (one per model)."""

    def __init__(self) -> None:
        self._storage: torch.Tensor | None = None

    def take(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialized tensor of ``shape``; its memory is reused by the next call."""
        numel = shape.numel()
        storage = self._storage
        if (storage is None or storage.numel() < numel or storage.dtype != dtype
                or storage.device != device):
            storage = self._storage = torch.empty(numel, dtype=dtype, device=device)
        return storage[:numel].view(shape)


class PackedWeight:
    """A (out, in) weight stored other than as a dense float matrix (a weight-only format,
    or a kernel's own layout); ``matmul`` is ``x @ weight.T``."""

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, in) -> (T, out) in x's dtype."""
        raise NotImplementedError

    def dequantized(self) -> torch.Tensor:
        """The float32 (out, in) weight this stands for."""
        raise NotImplementedError

    def gated_matmul(self, x: torch.Tensor) -> torch.Tensor | None:
        """For a weight stacking a gated MLP's gate over its up (out = 2 I): silu(x @
        gate.T) * (x @ up.T), (T, I), from one kernel call that never writes the (T, 2 I)
        products, equal bit for bit to ``silu_and_mul(matmul(x))``; or None where this
        layout has no such kernel here (the caller then takes those two steps)."""
        return None

    def fused_projection(self, rows: int, dtype: torch.dtype) -> FusedProjection | None:
        """The kernel and operands through which ``matmul`` multiplies ``rows`` rows of
        ``dtype`` while the fused kernels are on, or None where it takes another path (the
        fused decode layer, ``cpu_decode_layer``, then leaves the step to the modules)."""
        return None

    def nbytes(self) -> int:
        raise NotImplementedError

    def tensors(self) -> list[torch.Tensor]:
        """The tensors it holds."""
        return [value for value in vars(self).values() if isinstance(value, torch.Tensor)]


@dataclass(eq=False)
class HalfWeight(PackedWeight):
    buffer: ConversionBuffer
    weight: torch.Tensor  # (out, in) float16

    @classmethod
    def pack(cls, weight: torch.Tensor, buffer: ConversionBuffer) -> HalfWeight:
        """(Half weights stay in rows; in float32 the loader stores them as
        ``weight_storage.py`` does, in blocks.)"""
        return cls(buffer, weight.to(torch.float16).contiguous())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        out = self._kernel_product(x)
        if out is not None:  # x as stored, float32 sums
            return out
        if x.shape[0] == 1:
            return F.linear(x.to(torch.float16), self.weight).to(x.dtype)
        if x.shape[0] <= HALF_GEMV_MAX_ROWS:  # one matrix-vector product per row
            rows = [F.linear(row, self.weight) for row in x.to(torch.float16).split(1)]
            return torch.cat(rows).to(x.dtype)
        return self._widened_product(x)

    def _kernel_product(self, x: torch.Tensor) -> torch.Tensor | None:
        """x @ weight.T on the fused kernels' ``dense_matmul`` (the weight widened in
        registers) for up to ``half_fused_max_rows`` rows where they are on, else None."""
        if x.shape[0] <= half_fused_max_rows(x.dtype):
            kernels = fused_ops.for_tensor(x)
            if kernels is not None:
                return kernels.dense_matmul(x, self.weight)
        return None

    def _widened_product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T with the weight widened into the buffer in x's dtype."""
        wide = self.buffer.take(self.weight.shape, x.dtype, x.device)
        return F.linear(x, wide.copy_(self.weight))

    def fused_projection(self, rows: int, dtype: torch.dtype) -> FusedProjection | None:
        if rows <= half_fused_max_rows(dtype):
            return FusedProjection.of(ProjectionKernel.DENSE, self.weight)
        return None

    def dequantized(self) -> torch.Tensor:
        return self.weight.float()

    def nbytes(self) -> int:
        return self.weight.numel() * 2


@dataclass(eq=False)
class Int8Weight(PackedWeight):
    """``by_pairs``: the integers laid out by column pairs (``by_column_pairs``) instead of
    by rows, for bfloat16 passes of any number of rows on the kernels' ``int8_pair_matmul``
    (the integers widened to bfloat16 in registers, AVX-512 BF16 dot products: on a 2-core
    Zen 4 faster than its bfloat16 pairs at one row and about even from 16 rows, far faster
    than ``int8_matmul`` at 16 rows and than widening for oneDNN at 512; figures in
    benchmarks/RESULTS.md). Its products of a row do not depend on the pass's other rows.

    ``by_blocks``: the integers in column blocks (``by_column_blocks``), for float32 passes
    of any number of rows on the kernels' ``blocked_int8_matmul`` (16 outputs' integers of
    one input widened once for up to 6 rows; each output's sum scaled at the end): faster
    than ``int8_matmul`` at every row count measured, more so with more rows (beyond 128
    rows the rows are widened for torch's GEMM; blocks stay on the kernel; figures in
    benchmarks/RESULTS.md)."""

    buffer: ConversionBuffer
    weight: torch.Tensor | None  # (out, in) int8, unless by pairs or blocks
    scales: torch.Tensor  # (out,) float32: weight ~= int8 * scale, row by row
    kernel_scales: torch.Tensor  # (out,) bfloat16, as torch's int8 kernel takes them
    pairs: torch.Tensor | None = None  # (out / 16, in / 2, 16, 2) int8, if by pairs
    blocks: torch.Tensor | None = None  # (out / 16, in, 16) int8, if by blocks

    @classmethod
    def pack(cls, weight: torch.Tensor, buffer: ConversionBuffer, by_pairs: bool = False,
             by_blocks: bool = False) -> Int8Weight:
        """(A weight that does not fit the layout asked for stays in rows.)"""
        weight = weight.float()
        scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127  # (out,)
        quantized = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
        kernel_scales = scales.to(torch.bfloat16)
        if by_pairs and fits_column_pairs(quantized):
            return cls(buffer, None, scales, kernel_scales, pairs=by_column_pairs(quantized))
        if by_blocks and fits_column_blocks(quantized):
            return cls(buffer, None, scales, kernel_scales, blocks=by_column_blocks(quantized))
        return cls(buffer, quantized.contiguous(), scales, kernel_scales)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        kernels = fused_ops.for_tensor(x)
        if kernels is not None:
            if self.pairs is not None and x.dtype == torch.bfloat16:
                return kernels.int8_pair_matmul(x, self.pairs, self.scales)
            if self.blocks is not None and x.dtype == torch.float32:
                return kernels.blocked_int8_matmul(x, self.blocks, self.scales)
        weight = self._rows()
        if x.shape[0] <= int8_kernel_max_rows(x.dtype, fused=kernels is not None):
            if kernels is not None:  # x as stored, float32 scales and sums
                return kernels.int8_matmul(x, weight, self.scales)
            out = torch.ops.aten._weight_int8pack_mm(
                x.to(torch.bfloat16), weight, self.kernel_scales)  # (T, out) bfloat16
            return out.to(x.dtype)
        # The integers widen exactly; the scales apply to the (T, out) product, whose rows
        # are contiguous, not to the weight (scaling a bfloat16 weight row by row runs
        # torch's unvectorised broadcast loop, slower than scaling the product's columns).
        wide = self.buffer.take(weight.shape, x.dtype, x.device).copy_(weight)
        scales = self.kernel_scales if x.dtype == torch.bfloat16 else self.scales.to(x.dtype)
        return F.linear(x, wide).mul_(scales)

    def gated_matmul(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.pairs is None or x.dtype != torch.bfloat16 or not gates_by_pairs(self.pairs):
            return None
        kernels = fused_ops.for_tensor(x)
        return None if kernels is None else kernels.int8_pair_matmul_silu(x, self.pairs,
                                                                          self.scales)

    def _rows(self) -> torch.Tensor:
        """The (out, in) integers (anew where they are by pairs or blocks: only should the
        kernels be off, or the rows not of the layout's dtype)."""
        if self.pairs is not None:
            return from_column_pairs(self.pairs)
        if self.blocks is not None:
            return from_column_blocks(self.blocks)
        return self.weight

    def fused_projection(self, rows: int, dtype: torch.dtype) -> FusedProjection | None:
        if self.pairs is not None:
            if dtype != torch.bfloat16:
                return None
            return FusedProjection.of(ProjectionKernel.INT8_PAIRS, self.pairs, self.scales)
        if self.blocks is not None:
            if dtype != torch.float32:
                return None
            return FusedProjection.of(ProjectionKernel.INT8_BLOCKED, self.blocks, self.scales)
        if rows <= int8_kernel_max_rows(dtype, fused=True):
            return FusedProjection.of(ProjectionKernel.INT8, self.weight, self.scales)
        return None

    def dequantized(self) -> torch.Tensor:
        return self._rows().float() * self.scales[:, None]

    def nbytes(self) -> int:
        integers = next(t for t in (self.weight, self.pairs, self.blocks) if t is not None)
        return integers.numel() + self.scales.numel() * 4


def pack_weights(model: nn.Module, weight_format: str, by_pairs: bool = False,
                 by_blocks: bool = False) -> int:
    """Packs every module that offers ``pack_weight`` (the projections and the output head)
    into ``weight_format``; returns the packed weights' bytes. ``by_pairs``: int8 weights by
    column pairs (``Int8Weight``), where the model serves in bfloat16 and the kernels'
    ``int8_pair_matmul`` serves; ``by_blocks``: in column blocks, where it serves in
    float32 on the kernels. Raises ValueError for an unknown format."""
    buffer = ConversionBuffer()
    if weight_format == "fp16wo":
        return pack_each_weight(model, lambda weight: HalfWeight.pack(weight, buffer))
    if weight_format == "int8wo":
        return pack_each_weight(
            model, lambda weight: Int8Weight.pack(weight, buffer, by_pairs, by_blocks))
    raise ValueError(f"unknown weight format {weight_format!r}; "
                     f"expected one of {', '.join(WEIGHT_FORMATS)}")


def pack_each_weight(model: nn.Module, packer: Callable[[torch.Tensor], PackedWeight]) -> int:
    """Replaces the weight of every module that offers ``pack_weight`` (the projections and
    the output head) by ``packer(weight)``; returns the packed weights' bytes. Modules that
    hold their checkpoint's own packed format already (GGUF blocks) are left as they are."""
    total = 0
    for module in model.modules():
        pack = getattr(module, "pack_weight", None)
        if pack is not None and getattr(module, "weight", None) is not None:
            total += pack(packer)
    return total
