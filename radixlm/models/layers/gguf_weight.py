"""GGUF weights served in their block formats (llama.cpp's Q4_0 ... Q8_K), never widened
for good: the packed weights a GGUF checkpoint's layers hold (the GGUF loader builds them).

``GGUFBlockWeight`` keeps a matrix's blocks as the file stores them, uint8 (out, row bytes),
possibly a view of the read-only memory-mapped file (or the loader's huge-page copy of those
bytes): it never writes them and copies them only where they are not contiguous. A pass of
up to ``kernel_max_rows(x.dtype)`` rows on a CPU with the fused kernels on runs their
``quantized_matmul`` (blocks decoded in registers as the pass reads them); a longer pass
decodes the whole weight into the model's reused ``ConversionBuffer`` (the kernels'
``dequantize_blocks``, else ``dequantize_rows`` in torch, on any device) and multiplies
there with torch's GEMM. The crossover was measured on a 2-core AMX CPU
(benchmarks/RESULTS.md, ``bench_gguf_matmul.py``). ``rows`` decodes only the rows asked for
(the token embedding's lookup).

``StackedWeight`` stacks packed weights of possibly different types along the output
dimension (a checkpoint's q, k and v as one projection); GGUF parts on the kernels are
multiplied in one call (``quantized_matmul_parts``). Both give the fused decode layer
(``cpu_decode_layer``) their blocks for the passes that run the kernels.

Invariants: outputs come back in x's dtype with float32 sums; the decoded weight equals
``gguf.quants.dequantize``'s; the buffer is shared by one model's layers, so a model's
passes must not run concurrently (as for ``weight_formats``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixlm.kernels.cpu_ops import fused_ops
from radixlm.kernels.quantized.block_formats import (
    NATIVE_TYPES,
    QType,
    dequantize_rows,
    row_bytes,
)
from radixlm.models.layers.weight_formats import ConversionBuffer, FusedProjection, PackedWeight

KERNEL_MAX_ROWS_FLOAT32 = 32
"""Rows of float32 activations up to which a pass runs ``quantized_matmul``; longer ones
decode the weight for torch's GEMM. Where the two crossed on the AMX CPU: the kernel ahead
at 32 rows for a projection in Q4_K and Q8_0 and a vocabulary head in Q8_0, the two types
apart at 48 (benchmarks/RESULTS.md)."""
KERNEL_MAX_ROWS_BFLOAT16 = 16
"""The same for bfloat16 activations, whose GEMM after decoding is much cheaper there
(oneDNN on AMX tiles). On the AMX CPU the kernel (the dot products; the register path for
Q4_0 to Q5_1) is ahead alone at 12 rows for Q4_K, Q5_0, Q6_K and Q8_0 projections and the
Q8_0 head, even or behind at 16; but at 16 rows a decode step whose every projection runs
the kernel is one fused call a layer (``cpu_decode_layer``), and that step beat the modules'
decoding and GEMMs end to end on both GGUF files of ``bench_gguf.py`` (benchmarks/RESULTS.md).
Past 16 the kernel's time grows with the rows while decoding's does not."""


DECODE_CHUNK_VALUES = 1 << 22
"""A long pass decodes a matrix of more values than this (a vocabulary's output head) a
part of this many values at a time, each multiplied as it is decoded: the buffer stays that
size (not the whole head widened, hundreds of MiB held for the model's life) and each
part is still in cache when the GEMM reads it."""


def native_type(qtype: QType) -> bool:
    """Whether tensors of GGUF type ``qtype`` are served in their blocks."""
    return qtype in NATIVE_TYPES


def kernel_max_rows(dtype: torch.dtype) -> int:
    """The most rows of ``dtype`` a pass multiplies on the kernels' ``quantized_matmul``."""
    return KERNEL_MAX_ROWS_FLOAT32 if dtype == torch.float32 else KERNEL_MAX_ROWS_BFLOAT16


class GGUFBlockWeight(PackedWeight):
    """A (out, in) weight held as GGUF blocks of one type."""

    def __init__(self, blocks: torch.Tensor, qtype: QType, shape: tuple[int, int],
                 buffer: ConversionBuffer | None = None):
        """blocks: uint8 (out, row bytes) of type ``qtype`` for a (out, in) ``shape``;
        ``buffer``: where long passes decode the weight (None: a fresh tensor each time).
        ValueError where the type is not served in blocks or the shapes disagree."""
        if not native_type(qtype):
            raise ValueError(f"GGUF type {QType(qtype).name} is not served in blocks; "
                             f"served: {', '.join(sorted(t.name for t in NATIVE_TYPES))}")
        out_features, in_features = shape
        expected = (out_features, row_bytes(qtype, in_features))
        if blocks.dtype != torch.uint8 or tuple(blocks.shape) != expected:
            raise ValueError(f"{QType(qtype).name} blocks for a {tuple(shape)} weight must be "
                             f"uint8 {expected}, got {blocks.dtype} {tuple(blocks.shape)}")
        self.blocks = blocks if blocks.is_contiguous() else blocks.contiguous()
        self.qtype = QType(qtype)
        self.shape = (out_features, in_features)
        self.buffer = buffer

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, in) -> (T, out) in x's dtype."""
        kernels = fused_ops.for_tensor(x)
        if kernels is not None and self.on_kernels(x.shape[0], x.dtype):
            return kernels.quantized_matmul(x, self.blocks, int(self.qtype))
        dtype = x.dtype
        compute = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
        x = x.to(compute)
        out_features, in_features = self.shape
        step = max(1, DECODE_CHUNK_VALUES // in_features)
        if out_features <= step:
            wide = self._decoded_into(self.blocks, compute, x.device, kernels)  # (out, in)
            return F.linear(x, wide).to(dtype)
        out = x.new_empty(x.shape[0], out_features)
        for first in range(0, out_features, step):  # a tall matrix (an output head) by parts
            rows = self.blocks[first:first + step]
            out[:, first:first + len(rows)] = F.linear(
                x, self._decoded_into(rows, compute, x.device, kernels))
        return out.to(dtype)

    def on_kernels(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether a pass of ``rows`` rows of ``dtype`` runs the kernels' ``quantized_matmul``
        (where they are on)."""
        return (self.blocks.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
                and rows <= kernel_max_rows(dtype))

    def _decoded_into(self, blocks: torch.Tensor, dtype: torch.dtype, device: torch.device,
                      kernels) -> torch.Tensor:
        """``blocks`` (some of the weight's rows) decoded into the buffer (else a fresh
        tensor) in ``dtype``."""
        shape = torch.Size((blocks.shape[0], self.shape[1]))
        if self.buffer is not None:
            wide = self.buffer.take(shape, dtype, device)
        else:
            wide = torch.empty(shape, dtype=dtype, device=device)
        return self.decode_into(blocks, wide, kernels)

    def decode_into(self, blocks: torch.Tensor, wide: torch.Tensor, kernels) -> torch.Tensor:
        """``blocks`` (some of the weight's rows) decoded into ``wide`` (contiguous, rows by
        in), which it returns; ``kernels``: the fused kernels, or None."""
        if kernels is not None and blocks.device.type == "cpu" and wide.device.type == "cpu":
            kernels.dequantize_blocks(blocks, int(self.qtype), wide)
            return wide
        return wide.copy_(dequantize_rows(blocks.to(wide.device), self.qtype))

    def dequantized(self) -> torch.Tensor:
        """float32 (out, in), equal to ``gguf.quants.dequantize``'s."""
        return dequantize_rows(self.blocks, self.qtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (T,) int64 -> float32 (T, in): only those rows decoded."""
        return dequantize_rows(self.blocks.index_select(0, ids.to(self.blocks.device)),
                               self.qtype)

    def fused_projection(self, rows: int, dtype: torch.dtype) -> FusedProjection | None:
        if not self.on_kernels(rows, dtype):
            return None  # the weight decoded for torch's GEMM: no fused step
        return FusedProjection.gguf([self.blocks], [int(self.qtype)])

    def nbytes(self) -> int:
        return self.blocks.numel()

    def tensors(self) -> list[torch.Tensor]:
        return [self.blocks]


def _out_features(part: PackedWeight) -> int:
    shape = getattr(part, "shape", None)
    return shape[0] if shape is not None else part.dequantized().shape[0]


class StackedWeight(PackedWeight):
    """Packed weights (out_i, in) stacked along the output dimension into one
    (sum out_i, in): ``matmul`` writes each part's product into its columns of one output."""

    def __init__(self, parts: list[PackedWeight]):
        if not parts:
            raise ValueError("a StackedWeight needs at least one part")
        self.parts = list(parts)
        self.bounds: list[tuple[int, int]] = []  # each part's output columns [start, end)
        start = 0
        for part in self.parts:
            end = start + _out_features(part)
            self.bounds.append((start, end))
            start = end
        self.shape = (start, getattr(self.parts[0], "shape", (0, -1))[1])

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, in) -> (T, sum out_i) in x's dtype: GGUF parts that all run the kernels in
        one call of theirs; GGUF parts of longer passes decoded side by side into one buffer
        for one GEMM; else part by part."""
        kernels = fused_ops.for_tensor(x)
        if kernels is not None and self._on_kernels(x.shape[0], x.dtype):
            return kernels.quantized_matmul_parts(
                x, [part.blocks for part in self.parts], [int(part.qtype) for part in self.parts])
        wide = self._decoded(x, kernels)
        if wide is not None:
            return F.linear(x.to(wide.dtype), wide).to(x.dtype)
        out = x.new_empty(x.shape[0], self.bounds[-1][1])
        for part, (start, end) in zip(self.parts, self.bounds, strict=True):
            out[:, start:end] = part.matmul(x)
        return out

    def _decoded(self, x: torch.Tensor, kernels) -> torch.Tensor | None:
        """Every part decoded into its rows of the first part's buffer (sum out_i, in), in
        the dtype the parts multiply x in; None unless every part is a GGUF weight with that
        buffer and all of them fit one part of a long pass (``DECODE_CHUNK_VALUES``)."""
        first = self.parts[0]
        buffer = getattr(first, "buffer", None)
        if (buffer is None or self.shape[0] * self.shape[1] > DECODE_CHUNK_VALUES
                or any(not isinstance(part, GGUFBlockWeight) or part.buffer is not buffer
                       for part in self.parts)):
            return None
        compute = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32
        wide = buffer.take(torch.Size(self.shape), compute, x.device)
        for part, (start, end) in zip(self.parts, self.bounds, strict=True):
            part.decode_into(part.blocks, wide[start:end], kernels)
        return wide

    def _on_kernels(self, rows: int, dtype: torch.dtype) -> bool:
        return all(isinstance(part, GGUFBlockWeight) and part.on_kernels(rows, dtype)
                   for part in self.parts)

    def fused_projection(self, rows: int, dtype: torch.dtype) -> FusedProjection | None:
        if not self._on_kernels(rows, dtype):
            return None
        return FusedProjection.gguf([part.blocks for part in self.parts],
                                    [int(part.qtype) for part in self.parts])

    def dequantized(self) -> torch.Tensor:
        return torch.cat([part.dequantized() for part in self.parts])

    def nbytes(self) -> int:
        return sum(part.nbytes() for part in self.parts)

    def tensors(self) -> list[torch.Tensor]:
        return [tensor for part in self.parts for tensor in part.tensors()]
