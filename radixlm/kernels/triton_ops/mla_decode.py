"""Split-KV decode attention over MLA latents in Triton (DeepSeek-V2's absorbed attention).

With the up-projections absorbed into the query and output, multi-head latent attention
is multi-query attention over one shared row per token,

    row = [ c_kv : D_l (kv_lora_rank) | k_rope : D_r (qk_rope_head_dim) ],

whose key is the whole row and whose value is c_kv alone. The query is (H, D_l + D_r).
A program covers a block of query heads (all heads share the one KV head, so the block is
a real matmul tile), one request and one KV split; it loads each key block once as its
latent part (N, D_l) and its RoPE part (D_r, N), scores
``q_lat . c_kv + q_rope . k_rope``, and reuses the loaded latents as the values, so the
pool is read once per head block. Splits are merged as in ``decode_attention``.

Invariants: as for the split-KV decode kernel (new token already stored, n >= 1, empty
splits skipped by both stages); the kernel writes only ``out`` and the scratch buffers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm.kernels.triton_ops import tile_plan
from radixlm.kernels.triton_ops.decode_attention import decode_scratch, merge_splits
from radixlm.kernels.triton_ops.extend_attention import (
    LOG2E,
    MASKED,
    dot_precision,
    online_softmax_step,
)


@triton.jit
def _mla_decode_split_kernel(
    q_ptr, kv_buf_ptr, mid_o_ptr, mid_lse_ptr,
    req_to_token_ptr, req_pool_indices_ptr, seq_lens_ptr,
    scale_log2,
    stride_qb, stride_qh, stride_buf_slot, stride_req_row,
    stride_mid_b, stride_mid_h, stride_mid_s, stride_lse_b, stride_lse_h,
    num_heads, latent_dim, rope_dim,
    NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DL: tl.constexpr, BLOCK_DR: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)  # row offsets of large batches pass 2**31
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    split_len = tl.cdiv(seq_len, NUM_SPLITS)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    if lo >= hi:
        return
    row = tl.load(req_pool_indices_ptr + b).to(tl.int64)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    dl = tl.arange(0, BLOCK_DL)
    dr = tl.arange(0, BLOCK_DR)
    dl_mask = dl < latent_dim
    dr_mask = dr < rope_dim
    q_base = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q_lat = tl.load(q_base + dl[None, :], mask=h_mask[:, None] & dl_mask[None, :], other=0.0)
    q_rope = tl.load(
        q_base + latent_dim + dr[None, :], mask=h_mask[:, None] & dr_mask[None, :], other=0.0
    )  # (H_block, D_r)

    m_i = tl.full([BLOCK_H], MASKED, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DL], dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        slots = tl.load(
            req_to_token_ptr + row * stride_req_row + offs_n, mask=n_mask, other=0
        ).to(tl.int64)
        latents = tl.load(
            kv_buf_ptr + slots[:, None] * stride_buf_slot + dl[None, :],
            mask=n_mask[:, None] & dl_mask[None, :], other=0.0,
        )  # (N, D_l): keys' first part and the values
        k_rope = tl.load(
            kv_buf_ptr + slots[None, :] * stride_buf_slot + latent_dim + dr[:, None],
            mask=n_mask[None, :] & dr_mask[:, None], other=0.0,
        )  # (D_r, N)
        scores = tl.dot(q_lat, tl.trans(latents), input_precision=DOT_PRECISION)
        scores += tl.dot(q_rope, k_rope, input_precision=DOT_PRECISION)
        scores = tl.where(n_mask[None, :], scores * scale_log2, MASKED)
        m_i, l_i, acc = online_softmax_step(scores, m_i, l_i, acc, latents, DOT_PRECISION)

    mid = b * stride_mid_b + heads[:, None] * stride_mid_h + split * stride_mid_s + dl[None, :]
    tl.store(mid_o_ptr + mid, acc / l_i[:, None], mask=h_mask[:, None] & dl_mask[None, :])
    tl.store(
        mid_lse_ptr + b * stride_lse_b + heads * stride_lse_h + split,
        m_i + tl.log2(l_i), mask=h_mask,
    )


def mla_decode_attention(
    q: torch.Tensor, out: torch.Tensor, kv_buffer: torch.Tensor, latent_dim: int,
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
    scaling: float, num_kv_splits: int = 8,
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
    block_h: int = 16, block_n: int = 32,
) -> torch.Tensor:
    """Writes attention of q (B, H, D_l + D_r) over the latent rows into out (B, H, D_l).

    kv_buffer: the layer's latent pool (slots, 1, D_l + D_r), contiguous rows; ``scratch``
    as for ``decode_attention``, with D_l columns. ``block_n`` is the largest key tile
    wanted: on a GPU it shrinks to fit its shared memory (``tile_plan.mla_decode_tiles``).
    """
    if q.stride(-1) != 1:
        q = q.contiguous()
    batch_size, num_heads, row_dim = q.shape
    if kv_buffer.shape[1] != 1 or kv_buffer.shape[2] != row_dim or kv_buffer.stride(2) != 1:
        raise ValueError(
            f"the latent pool must be (slots, 1, {row_dim}) with contiguous rows, "
            f"got {tuple(kv_buffer.shape)}"
        )
    rope_dim = row_dim - latent_dim
    if batch_size == 0:
        return out
    if scratch is None:
        scratch = decode_scratch(batch_size, num_heads, latent_dim, num_kv_splits, q.device)
    mid_o, mid_lse = scratch[0][:batch_size], scratch[1][:batch_size]
    if mid_o.shape[1:] != (num_heads, num_kv_splits, latent_dim):
        raise ValueError(f"scratch {tuple(mid_o.shape)} does not fit this layer's heads/splits")
    tiles = tile_plan.mla_decode_tiles(latent_dim, rope_dim, q.dtype,
                                       tile_plan.shared_memory_per_block(q.device), block_h,
                                       block_n)
    grid = (batch_size, triton.cdiv(num_heads, block_h), num_kv_splits)
    _mla_decode_split_kernel[grid](
        q, kv_buffer, mid_o, mid_lse,
        req_to_token, req_pool_indices, seq_lens,
        scaling * LOG2E,
        q.stride(0), q.stride(1), kv_buffer.stride(0), req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        num_heads, latent_dim, rope_dim,
        NUM_SPLITS=num_kv_splits, BLOCK_H=block_h, BLOCK_N=tiles.block_n,
        BLOCK_DL=tile_plan.padded(latent_dim), BLOCK_DR=tile_plan.padded(rope_dim),
        DOT_PRECISION=dot_precision(q.dtype), **tiles.launch_options(),
    )
    merge_splits(mid_o, mid_lse, out, seq_lens)
    return out
