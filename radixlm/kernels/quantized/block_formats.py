"""GGUF's block-quantized weight formats (llama.cpp's ``ggml-quants``), as torch code.

A GGUF matrix (out, in) of a block type is ``out`` rows of ``in / values`` blocks, each
block ``bytes`` long (``gguf.GGML_QUANT_SIZES``): Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 hold 32
values a block, one float16 scale (and a float16 minimum for the _1 types); the K types hold
256-value super-blocks of 16- or 32-value sub-blocks with 6- or 8-bit sub-scales. The byte
layouts are llama.cpp's, as ``gguf.quants`` writes them out in numpy.

``dequantize_rows`` decodes whole rows with vectorized torch operations on the blocks'
device (no Python loop over blocks). Invariant: its float32 values equal
``gguf.quants.dequantize`` bit for bit, the float32 products taken in the same order
(``(d * scale) * q - dmin * min``); Q8_K, which ``gguf.quants`` does not decode, is
``d * q`` as llama.cpp's ``dequantize_row_q8_K``. The fused CPU kernels
(``kernels/cpu_ops/quantized_matmul.cpp``) decode the same layouts and switch on the same
type numbers (``gguf.GGMLQuantizationType``'s values, the format's own).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import gguf
import torch

QType = gguf.GGMLQuantizationType


class BlockGeometry(NamedTuple):
    """One block of a type: how many values it holds and how many bytes it takes."""

    values: int
    bytes: int


NATIVE_TYPES = frozenset({QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0,
                          QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.Q8_K})
"""The types served in their blocks (decoded here and by the CPU kernels)."""


def geometry(qtype: QType) -> BlockGeometry:
    """The block geometry of a served type; ValueError naming the served ones otherwise."""
    if qtype not in NATIVE_TYPES:
        served = ", ".join(sorted(t.name for t in NATIVE_TYPES))
        raise ValueError(f"GGUF type {QType(qtype).name} is not served in blocks; "
                         f"served: {served}")
    return BlockGeometry(*gguf.GGML_QUANT_SIZES[QType(qtype)])


def row_bytes(qtype: QType, in_features: int) -> int:
    """Bytes of one row of ``in_features`` values; ValueError unless they fill whole blocks."""
    values, size = geometry(qtype)
    if in_features <= 0 or in_features % values:
        raise ValueError(f"a {QType(qtype).name} row holds a multiple of {values} values, "
                         f"got {in_features}")
    return in_features // values * size


def dequantize_rows(blocks: torch.Tensor, qtype: QType) -> torch.Tensor:
    """blocks: uint8 (rows, row_bytes), whole blocks per row -> float32 (rows, in), on the
    blocks' device. Equal bit for bit to ``gguf.quants.dequantize``."""
    values, size = geometry(qtype)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % size:
        raise ValueError(f"blocks must be uint8 (rows, k * {size}) for {QType(qtype).name}, "
                         f"got {blocks.dtype} {tuple(blocks.shape)}")
    rows, per_row = blocks.shape[0], blocks.shape[1] // size
    flat = blocks.reshape(rows * per_row, size)  # (n, bytes): one block a row
    return _DECODERS[QType(qtype)](flat).reshape(rows, per_row * values)


def _half(flat: torch.Tensor, at: int) -> torch.Tensor:
    """(n, 1) float32 from the float16 at byte ``at`` of each block."""
    return flat[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, g, b) bytes -> (n, g, 2 b): each group's low nibbles, then its high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """(n, b) bytes -> (n, count, b): bit i of every byte in row i (i < count)."""
    shifts = torch.arange(count, dtype=torch.uint8, device=qh.device).view(1, count, 1)
    return (qh.unsqueeze(1) >> shifts) & 1


def _q4_0(flat: torch.Tensor) -> torch.Tensor:
    q = _nibbles(flat[:, 2:18]).to(torch.int8) - 8  # (n, 32)
    return _half(flat, 0) * q.float()


def _q4_1(flat: torch.Tensor) -> torch.Tensor:
    q = _nibbles(flat[:, 4:20]).float()
    return _half(flat, 0) * q + _half(flat, 2)


def _five_bits(flat: torch.Tensor, high_at: int) -> torch.Tensor:
    """(n, 32) uint8: the low nibbles after the 4 high-bit bytes at ``high_at``, each
    value's fifth bit from bit i of those bytes read as one little-endian uint32."""
    low = _nibbles(flat[:, high_at + 4:high_at + 20])
    high = _bits(flat[:, high_at:high_at + 4], 8).transpose(1, 2).reshape(-1, 32)
    return low | (high << 4)


def _q5_0(flat: torch.Tensor) -> torch.Tensor:
    q = _five_bits(flat, 2).to(torch.int8) - 16
    return _half(flat, 0) * q.float()


def _q5_1(flat: torch.Tensor) -> torch.Tensor:
    return _half(flat, 0) * _five_bits(flat, 4).float() + _half(flat, 2)


def _q8_0(flat: torch.Tensor) -> torch.Tensor:
    return flat[:, 2:34].contiguous().view(torch.int8).float() * _half(flat, 0)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's 12 bytes -> the 8 sub-blocks' 6-bit scales and minimums, (n, 8)."""
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mins


def _k_affine(flat: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(d * scale) * q - dmin * min over 8 sub-blocks of 32, q (n, 8, 32) uint8."""
    sc, mins = _k_scales(flat[:, 4:16])
    scale = (_half(flat, 0) * sc.float()).unsqueeze(-1)  # (n, 8, 1)
    offset = (_half(flat, 2) * mins.float()).unsqueeze(-1)
    return (scale * q.float() - offset).reshape(-1, 256)


def _q4_k(flat: torch.Tensor) -> torch.Tensor:
    q = _nibbles(flat[:, 16:144].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    return _k_affine(flat, q)


def _q5_k(flat: torch.Tensor) -> torch.Tensor:
    low = _nibbles(flat[:, 48:176].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    high = _bits(flat[:, 16:48], 8)  # (n, 8, 32): sub-block s takes bit s
    return _k_affine(flat, low | (high << 4))


def _q6_k(flat: torch.Tensor) -> torch.Tensor:
    low = _nibbles(flat[:, 0:128].reshape(-1, 2, 64)).reshape(-1, 8, 32)
    qh = flat[:, 128:192].reshape(-1, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=flat.device).view(1, 1, 4, 1)
    high = ((qh >> shifts) & 3).reshape(-1, 8, 32)
    q = (low | (high << 4)).to(torch.int8) - 32  # (n, 8, 32)
    scales = flat[:, 192:208].contiguous().view(torch.int8).float()  # (n, 16)
    scale = (_half(flat, 208) * scales).unsqueeze(-1)  # (n, 16, 1)
    return (scale * q.reshape(-1, 16, 16).float()).reshape(-1, 256)


def _q8_k(flat: torch.Tensor) -> torch.Tensor:
    d = flat[:, 0:4].contiguous().view(torch.float32)
    return flat[:, 4:260].contiguous().view(torch.int8).float() * d


_DECODERS: dict[QType, Callable[[torch.Tensor], torch.Tensor]] = {
    QType.Q4_0: _q4_0, QType.Q4_1: _q4_1, QType.Q5_0: _q5_0, QType.Q5_1: _q5_1,
    QType.Q8_0: _q8_0, QType.Q4_K: _q4_k, QType.Q5_K: _q5_k, QType.Q6_K: _q6_k,
    QType.Q8_K: _q8_k,
}
