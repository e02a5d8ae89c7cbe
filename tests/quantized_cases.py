"""Random GGUF blocks of every served type and their reference decoding, for the tests of
block_formats, the CPU block kernels and the packed GGUF weight."""

from __future__ import annotations

import gguf
import gguf.quants
import numpy as np

from radixlm.kernels.quantized.block_formats import QType

QUANTIZED_BY_GGUF = {QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0}
# Byte offsets of each K type's float16 scales (d, and dmin where it has one).
HALF_SCALES = {QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208,)}


def random_blocks(qtype: QType, rows: int, blocks_per_row: int,
                  seed: int) -> np.ndarray:
    """uint8 (rows, blocks_per_row * bytes): gguf's quantization of normal values where it
    quantizes this type, else random bytes whose scales are finite float16 in [-1, 1]."""
    rng = np.random.default_rng(seed)
    values, size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype in QUANTIZED_BY_GGUF:
        data = rng.standard_normal((rows, blocks_per_row * values)).astype(np.float32)
        return gguf.quants.quantize(data, qtype)
    raw = rng.integers(0, 256, (rows * blocks_per_row, size), dtype=np.uint8)
    if qtype == QType.Q8_K:
        scales = rng.uniform(-1, 1, (rows * blocks_per_row, 1)).astype(np.float32)
        raw[:, 0:4] = scales.view(np.uint8)
    for at in HALF_SCALES.get(qtype, ()):
        scales = rng.uniform(-1, 1, (rows * blocks_per_row, 1)).astype(np.float16)
        raw[:, at:at + 2] = scales.view(np.uint8)
    return raw.reshape(rows, blocks_per_row * size)


def reference(blocks: np.ndarray, qtype: QType) -> np.ndarray:
    """gguf's float32 decoding; Q8_K (absent from gguf.quants) as llama.cpp's
    ``dequantize_row_q8_K``: block = float32 d, int8 qs[256], int16 bsums[16]; value d * q."""
    if qtype != QType.Q8_K:
        return gguf.quants.dequantize(blocks, qtype)
    flat = blocks.reshape(-1, 292)
    d = flat[:, 0:4].copy().view(np.float32)
    q = flat[:, 4:260].copy().view(np.int8).astype(np.float32)
    return (d * q).reshape(blocks.shape[0], -1)
