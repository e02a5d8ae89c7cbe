"""16-bit weight storage for a model served in float32 on a CPU (``dtype=auto`` there).

On a CPU without native bfloat16 arithmetic the model computes in float32, and a float32
weight takes 4 bytes. A decode step of a few rows reads every weight once and does little
with it, so its time is the weights' bytes over the memory bandwidth. ``dtype=auto``
therefore keeps each projection's weight (and the output head's) in 2 bytes and widens it
to float32 where it is multiplied, in registers by the fused CPU kernels. A weight whose rows
are a multiple of 16 (every one of the default model's) is kept in column blocks
(``BlockedWeight``), whose kernel takes passes of every length; others in rows
(``WidenedWeight``), whose kernel takes passes of up to ``HALF_FUSED_MAX_ROWS_FLOAT32`` rows,
larger ones (long prompts) widening the weight into a reused float32 buffer for torch's
GEMM. A weight's values are stored

- as bfloat16 where every value is a bfloat16 number (a bfloat16 checkpoint's): exact;
- else as float16, rounded to nearest (11 significant bits, 2^-12 relative error; values
  below 2^-14 lose bits, below 2^-24 become 0). That is the precision SGLang's and vLLM's
  ``auto`` gives a float32 checkpoint (float16) and finer than the bfloat16 (8 bits) that
  ``auto`` computes in on GPUs and native-bfloat16 CPUs; the default model's weights:
  0.26% of them below 2^-14, none beyond float16's range;
- else (a value beyond float16's range, 65504, or NaN) as it is, in float32.

Activations, sums, norms, attention and the KV cache stay float32; ``--dtype float32``
keeps every weight in float32 (the reference the fidelity tests compare with).

On a 2-core AVX2 CPU (Zen 3, no AVX-512), 16-bit weights in rows took about half the time
of float32 weights on the same kernel at one row, and less at 16 rows, and far less than
torch's; widening all the weights for a large pass is a few percent of a served prompt's
pass, which is why passes of up to ``HALF_FUSED_MAX_ROWS_FLOAT32`` rows stay on the rows'
kernel; the batch-1 decode step got faster by about two fifths. Column blocks
(``BlockedWeight``) are faster again, at every length. Figures in benchmarks/RESULTS.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from radixlm.kernels.cpu_ops import fused_ops
from radixlm.kernels.cpu_ops.fused_ops import ProjectionKernel
from radixlm.models.layers.column_layouts import (
    by_column_blocks,
    fits_column_blocks,
    from_column_blocks,
)
from radixlm.models.layers.weight_formats import (
    ConversionBuffer,
    FusedProjection,
    HalfWeight,
    PackedWeight,
)

SIXTEEN_BIT_STORAGE = "16-bit"
"""The loader's name for this packing (not a ``--quantization`` choice: ``dtype=auto``
picks it, ``model_executor.model_runner``)."""


def storage_dtype(weight: torch.Tensor, half_only: bool = False) -> torch.dtype | None:
    """The 16-bit type a float32 ``weight`` is stored in (bfloat16 where that is exact,
    else float16; ``half_only``: float16), or None where it stays float32 (a value beyond
    float16's range, NaN)."""
    if weight.dtype != torch.float32:
        return None
    if not half_only and torch.equal(weight.to(torch.bfloat16).float(), weight):
        return torch.bfloat16
    if bool(torch.isfinite(weight.to(torch.float16)).all()):
        return torch.float16
    return None


class WidenedWeight(HalfWeight):
    """A float32 (out, in) weight stored as bfloat16 or float16 (``weight``), multiplied in
    float32: on the kernels for a few rows, else widened into the buffer (never with the
    activations rounded, as ``HalfWeight``'s torch paths do)."""

    @classmethod
    def pack(cls, weight: torch.Tensor, buffer: ConversionBuffer) -> WidenedWeight:
        """``weight`` (float32) in its ``storage_dtype``, in rows; ValueError for one that
        must stay float32. (It replaces ``HalfWeight.pack``, which would round to float16.)"""
        dtype = storage_dtype(weight)
        if dtype is None:
            raise ValueError("weight must be float32 and within float16's range, without NaN")
        return cls.stored_as(weight, dtype, buffer)

    @classmethod
    def stored_as(cls, weight: torch.Tensor, dtype: torch.dtype,
                  buffer: ConversionBuffer) -> WidenedWeight:
        return cls(buffer, weight.to(dtype).contiguous())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        out = self._kernel_product(x)
        return self._widened_product(x) if out is None else out


@dataclass(eq=False)
class BlockedWeight(PackedWeight):
    """A float32 (out, in) weight (out a multiple of ``BLOCK_COLUMNS``) stored as bfloat16 or
    float16 in column blocks: ``blocks`` (out / 16, in, 16), blocks[b, k, j] = weight[16 b +
    j, k], so that the 16 outputs' weights of one input are contiguous.

    Float32 passes of any number of rows run the kernels' ``blocked_matmul``, which widens
    those 16 weights once and multiplies them by up to 6 rows' inputs (the rows' own kernel,
    ``dense_matmul``, widens each weight once per 4 rows). It is faster than the rows'
    kernel at 1 and 16 rows, and unlike that kernel it outruns widening the weights for
    torch's GEMM at every prompt length measured (figures in benchmarks/RESULTS.md). Without the
    kernels the blocks are widened into the buffer as an (in, out) matrix for torch's
    GEMM."""

    buffer: ConversionBuffer
    blocks: torch.Tensor  # (out / 16, in, 16) bfloat16 or float16

    @classmethod
    def stored_as(cls, weight: torch.Tensor, dtype: torch.dtype,
                  buffer: ConversionBuffer) -> BlockedWeight:
        return cls(buffer, by_column_blocks(weight.to(dtype)))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            kernels = fused_ops.for_tensor(x)
            if kernels is not None:
                return kernels.blocked_matmul(x, self.blocks)
        return self._widened_product(x)

    def _widened_product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T with the blocks widened into the buffer as weight.T (in, out)."""
        count, in_features, columns = self.blocks.shape
        wide = self.buffer.take(torch.Size((in_features, count * columns)), x.dtype, x.device)
        wide.view(in_features, count, columns).copy_(self.blocks.transpose(0, 1))
        return torch.matmul(x, wide)

    def fused_projection(self, rows: int, dtype: torch.dtype) -> FusedProjection | None:
        if dtype == torch.float32:
            return FusedProjection.of(ProjectionKernel.BLOCKED, self.blocks)
        return None

    def dequantized(self) -> torch.Tensor:
        return from_column_blocks(self.blocks).float()

    def nbytes(self) -> int:
        return self.blocks.numel() * 2


def stored_in(weight: torch.Tensor, dtype: torch.dtype,
              buffer: ConversionBuffer) -> PackedWeight:
    """``weight`` (float32) stored as ``dtype``: in column blocks where its rows are a
    multiple of ``BLOCK_COLUMNS``, else in rows."""
    if fits_column_blocks(weight):
        return BlockedWeight.stored_as(weight, dtype, buffer)
    return WidenedWeight.stored_as(weight, dtype, buffer)


def store_in_16_bits(model: nn.Module, half_only: bool = False) -> dict[str, int]:
    """Packs the weight of every module that offers ``pack_weight`` (the projections and
    the output head) in its ``storage_dtype`` (``stored_in``; ``half_only``: float16, the
    ``fp16wo`` format served in float32); returns how many weights went to each type
    ("bfloat16", "float16", "float32" for those left as they were) and the packed bytes
    ("bytes"); a weight packed already is left alone. Call it on the float32 model, after
    loading and before the parameters take the serving dtype."""
    buffer = ConversionBuffer()
    counts = {"bfloat16": 0, "float16": 0, "float32": 0, "bytes": 0}
    for module in model.modules():
        pack = getattr(module, "pack_weight", None)
        weight = getattr(module, "weight", None)
        if (pack is None or not isinstance(weight, torch.Tensor)
                or getattr(module, "packed", None) is not None):  # (packed already)
            continue
        dtype = storage_dtype(weight.detach(), half_only)
        if dtype is None:
            counts["float32"] += 1
            continue
        counts[str(dtype).removeprefix("torch.")] += 1
        counts["bytes"] += pack(lambda w, dtype=dtype: stored_in(w, dtype, buffer))
    return counts
