"""GGUF block-quantized weights multiplied on GPUs: x (M, K) @ W.T, W (N, K) held as its
GGUF blocks, uint8 (N, row bytes) (llama.cpp's layouts; ``kernels/quantized/block_formats``
decodes the same in torch, ``kernels/cpu_ops/quantized_matmul.cpp`` on CPUs).

A program computes a (BLOCK_M, BLOCK_N) tile of the output: for each GGUF block along K it
gathers the block's bytes for BLOCK_N weight rows, decodes them in registers into a
(BLOCK_N, values) float32 tile (each value's byte, bit shift and scale found from its index
in the block, so one code path serves a type's every value) and multiplies it with x's
(BLOCK_M, values) tile. Sums in float32; float32 activations multiply in IEEE float32 (no
TF32), bfloat16 and float16 ones widened to float32 and multiplied in TF32 (finer than their
own rounding; Triton's interpreter computed 16-bit dots wrongly, so the kernel has none).
The decoded values are ``gguf.quants.dequantize``'s: the same float32 products in the same
order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm.kernels.quantized.block_formats import QType, geometry

BLOCK_M = 16
BLOCK_N = 32


@triton.jit
def _byte(block, offset):
    """(BLOCK_N, V) bytes at ``offset`` (V,) of each row's block, as int32."""
    return tl.load(block + offset[None, :]).to(tl.int32)


@triton.jit
def _half(block, offset):
    """(BLOCK_N, 1) float32 from the float16 at byte ``offset`` of each row's block."""
    low = tl.load(block + offset).to(tl.uint16)
    high = tl.load(block + offset + 1).to(tl.uint16)
    return (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _k_scale(block, s, HIGH: tl.constexpr):
    """Q4_K's and Q5_K's 6-bit sub-block scale (HIGH=0) or minimum (HIGH=1) of sub-block
    ``s`` (V,), as float32 (BLOCK_N, V)."""
    low_s = tl.where(s < 4, s, s - 4)
    first = _byte(block, 4 + 4 * HIGH + low_s)  # s < 4: the low 6 bits are the value
    packed = _byte(block, 12 + low_s)  # s >= 4: a nibble of bytes 8-11 of the scales, ...
    top = first >> 6  # ... over the top 2 bits of bytes 0-3 (scales) or 4-7 (minimums)
    nibble = (packed >> (4 * HIGH)) & 15
    return tl.where(s[None, :] < 4, first & 63, nibble | (top << 4)).to(tl.float32)


@triton.jit
def _decode(block, QTYPE: tl.constexpr, V: tl.constexpr):
    """The (BLOCK_N, V) float32 values of one block of each row; ``block`` (BLOCK_N, 1)
    pointers to the blocks' first bytes."""
    i = tl.arange(0, V)
    if QTYPE == 2:  # Q4_0: f16 d, 16 bytes of nibbles (low: values 0-15)
        q = (_byte(block, 2 + i % 16) >> (4 * (i // 16))[None, :]) & 15
        return _half(block, 0) * (q - 8).to(tl.float32)
    elif QTYPE == 3:  # Q4_1: d, m, nibbles
        q = (_byte(block, 4 + i % 16) >> (4 * (i // 16))[None, :]) & 15
        return _half(block, 0) * q.to(tl.float32) + _half(block, 2)
    elif QTYPE == 6:  # Q5_0: d, 4 bytes of fifth bits, nibbles
        low = (_byte(block, 6 + i % 16) >> (4 * (i // 16))[None, :]) & 15
        high = (_byte(block, 2 + i // 8) >> (i % 8)[None, :]) & 1
        return _half(block, 0) * ((low | (high << 4)) - 16).to(tl.float32)
    elif QTYPE == 7:  # Q5_1: d, m, fifth bits, nibbles
        low = (_byte(block, 8 + i % 16) >> (4 * (i // 16))[None, :]) & 15
        high = (_byte(block, 4 + i // 8) >> (i % 8)[None, :]) & 1
        return _half(block, 0) * (low | (high << 4)).to(tl.float32) + _half(block, 2)
    elif QTYPE == 8:  # Q8_0: d, 32 int8
        q = _byte(block, 2 + i)
        q = tl.where(q >= 128, q - 256, q)
        return q.to(tl.float32) * _half(block, 0)
    elif QTYPE == 12 or QTYPE == 13:  # Q4_K, Q5_K: d, dmin, 12 bytes of scales, ...
        s = i // 32
        scale = _half(block, 0) * _k_scale(block, s, 0)
        offset = _half(block, 2) * _k_scale(block, s, 1)
        if QTYPE == 12:  # ... 128 bytes of nibbles: sub-blocks 2p and 2p + 1 share 32
            q = (_byte(block, 16 + 32 * (s // 2) + i % 32) >> (4 * (s % 2))[None, :]) & 15
        else:  # ... 32 bytes of fifth bits (bit s), 128 of nibbles
            low = (_byte(block, 48 + 32 * (s // 2) + i % 32) >> (4 * (s % 2))[None, :]) & 15
            high = (_byte(block, 16 + i % 32) >> s[None, :]) & 1
            q = low | (high << 4)
        return scale * q.to(tl.float32) - offset
    elif QTYPE == 14:  # Q6_K: 128 bytes of low nibbles, 64 of 2-bit tops, 16 int8 scales, d
        h = i // 128
        r = i % 128
        low = (_byte(block, 64 * h + r % 64) >> (4 * (r // 64))[None, :]) & 15
        high = (_byte(block, 128 + 32 * h + r % 32) >> (2 * (r // 32))[None, :]) & 3
        sc = _byte(block, 192 + i // 16)
        sc = tl.where(sc >= 128, sc - 256, sc)
        return (_half(block, 208) * sc.to(tl.float32)) * ((low | (high << 4)) - 32).to(
            tl.float32)
    else:  # Q8_K: f32 d, 256 int8 (then 16 int16 sums, unused)
        bits = (tl.load(block).to(tl.uint32) | (tl.load(block + 1).to(tl.uint32) << 8)
                | (tl.load(block + 2).to(tl.uint32) << 16)
                | (tl.load(block + 3).to(tl.uint32) << 24))
        d = bits.to(tl.float32, bitcast=True)
        q = _byte(block, 4 + i)
        q = tl.where(q >= 128, q - 256, q)
        return d * q.to(tl.float32)


@triton.jit
def _quantized_matmul_kernel(x, w, out, M, N, K, row_bytes,
                             QTYPE: tl.constexpr, V: tl.constexpr, BYTES: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             DOT_PRECISION: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) weight rows
    row_ok = rows < M
    col_ok = cols < N
    safe_cols = tl.where(col_ok, cols, 0)  # (rows past N read row 0, then masked)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_index = tl.arange(0, V)
    for j in range(0, K // V):
        block = w + safe_cols[:, None].to(tl.int64) * row_bytes + j * BYTES  # (BLOCK_N, 1)
        weights = _decode(block, QTYPE, V)  # (BLOCK_N, V) float32
        x_tile = tl.load(x + rows[:, None].to(tl.int64) * K + j * V + k_index[None, :],
                         mask=row_ok[:, None], other=0.0)  # (BLOCK_M, V)
        acc += tl.dot(x_tile.to(tl.float32), tl.trans(weights),
                      input_precision=DOT_PRECISION)
    tl.store(out + rows[:, None].to(tl.int64) * N + cols[None, :],
             acc.to(out.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def quantized_matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: QType) -> torch.Tensor:
    """x (M, K) float32, bfloat16 or float16 @ the weight ``blocks`` (N, row bytes) of
    ``qtype`` stands for, transposed -> (M, N) in x's dtype. Both on one device (a GPU, or
    the CPU under TRITON_INTERPRET=1)."""
    values, size = geometry(qtype)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % size:
        raise ValueError(f"blocks must be uint8 (N, k * {size}), got {blocks.dtype} "
                         f"{tuple(blocks.shape)}")
    K = blocks.shape[1] // size * values
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"x must be (M, {K}) for these blocks, got {tuple(x.shape)}")
    x, blocks = x.contiguous(), blocks.contiguous()
    M, N = x.shape[0], blocks.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _quantized_matmul_kernel[grid](
        x, blocks, out, M, N, K, blocks.shape[1], QTYPE=int(qtype), V=values, BYTES=size,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    return out
