"""Split-KV decode attention in Triton (flash-decoding): one query per request over its paged KV.

A decode step has few queries and long key ranges, so one program per (request, head) leaves
most of the GPU idle. Each request's keys are cut into ``num_kv_splits`` equal ranges:

- stage 1, grid (request, KV head, split): the query heads of one KV head (GQA group, padded
  to a tensor-core tile) attend to the split's keys, read through ``req_to_token``; each
  split writes its normalized partial output and its log-sum-exp (base 2);
- stage 2, grid (request, query head): the splits are merged by their log-sum-exps,
  ``out = sum_s 2^(lse_s - lse) * o_s`` with ``lse = log2 sum_s 2^lse_s``.

A request with n keys attends to keys [lo, n): lo = 0, or max(0, n - W) for a layer with a
sliding window W (``window`` > 0), so a long context's decode reads only its window. Split
s covers keys [lo + s * ceil((n - lo) / S), min(lo + (s + 1) * ceil((n - lo) / S), n)); both
stages derive that range from ``seq_lens`` and the window alone, so an empty split is
skipped by both without a sentinel, and the grid depends only on the batch size (CUDA-graph
friendly). A logit softcap c turns each scaled score s into c * tanh(s / c); a slot map
(request slot -> layer slot) is applied to the slots read from ``req_to_token``.

Invariants: the new token's K/V are already in the pool at ``req_to_token[row, n - 1]``;
every request has n >= 1; the kernels write only ``out`` and the scratch buffers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm.kernels.triton_ops.extend_attention import (
    LOG2E,
    MASKED,
    dot_precision,
    online_softmax_step,
    scaled_scores,
)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_buf_ptr, v_buf_ptr, mid_o_ptr, mid_lse_ptr,
    req_to_token_ptr, req_pool_indices_ptr, seq_lens_ptr, slot_map_ptr,
    scale_log2, window, softcap,
    stride_qb, stride_qh, stride_kbuf_slot, stride_kbuf_h, stride_vbuf_slot, stride_vbuf_h,
    stride_req_row, stride_mid_b, stride_mid_h, stride_mid_s, stride_lse_b, stride_lse_h,
    kv_group, head_dim_k, head_dim_v,
    NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SLOT_MAP: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)  # row offsets of large batches pass 2**31
    kv_h = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(seq_len - window, 0)
    split_len = tl.cdiv(seq_len - first, NUM_SPLITS)
    lo = first + split * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    if lo >= hi:
        return
    row = tl.load(req_pool_indices_ptr + b).to(tl.int64)

    group_rows = tl.arange(0, BLOCK_H)
    h_mask = group_rows < kv_group
    heads = kv_h * kv_group + group_rows
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    dk_mask = dk < head_dim_k
    dv_mask = dv < head_dim_v
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + dk[None, :],
        mask=h_mask[:, None] & dk_mask[None, :], other=0.0,
    )  # (H_group, DK)

    m_i = tl.full([BLOCK_H], MASKED, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        slots = tl.load(
            req_to_token_ptr + row * stride_req_row + offs_n, mask=n_mask, other=0
        ).to(tl.int64)
        if HAS_SLOT_MAP:
            slots = tl.load(slot_map_ptr + slots, mask=n_mask, other=0).to(tl.int64)
        k = tl.load(
            k_buf_ptr + slots[None, :] * stride_kbuf_slot + kv_h * stride_kbuf_h + dk[:, None],
            mask=n_mask[None, :] & dk_mask[:, None], other=0.0,
        )  # (DK, N)
        scores = scaled_scores(q, k, scale_log2, softcap, DOT_PRECISION, HAS_SOFTCAP)
        scores = tl.where(n_mask[None, :], scores, MASKED)
        v = tl.load(
            v_buf_ptr + slots[:, None] * stride_vbuf_slot + kv_h * stride_vbuf_h + dv[None, :],
            mask=n_mask[:, None] & dv_mask[None, :], other=0.0,
        )  # (N, DV)
        m_i, l_i, acc = online_softmax_step(scores, m_i, l_i, acc, v, DOT_PRECISION)

    mid = b * stride_mid_b + heads[:, None] * stride_mid_h + split * stride_mid_s + dv[None, :]
    tl.store(mid_o_ptr + mid, acc / l_i[:, None], mask=h_mask[:, None] & dv_mask[None, :])
    tl.store(
        mid_lse_ptr + b * stride_lse_b + heads * stride_lse_h + split,
        m_i + tl.log2(l_i), mask=h_mask,
    )


@triton.jit
def _merge_splits_kernel(
    mid_o_ptr, mid_lse_ptr, o_ptr, seq_lens_ptr, window,
    stride_mid_b, stride_mid_h, stride_mid_s, stride_lse_b, stride_lse_h,
    stride_ob, stride_oh, head_dim_v,
    NUM_SPLITS: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    if HAS_WINDOW:  # the splits cover the window's keys only, as in stage 1
        seq_len = tl.minimum(seq_len, window)
    split_len = tl.cdiv(seq_len, NUM_SPLITS)
    dv = tl.arange(0, BLOCK_DV)
    dv_mask = dv < head_dim_v
    m = tl.full([], MASKED, dtype=tl.float32)
    total = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for s in range(NUM_SPLITS):
        if s * split_len < seq_len:
            lse = tl.load(mid_lse_ptr + b * stride_lse_b + h * stride_lse_h + s)
            o = tl.load(
                mid_o_ptr + b * stride_mid_b + h * stride_mid_h + s * stride_mid_s + dv,
                mask=dv_mask, other=0.0,
            )
            m_new = tl.maximum(m, lse)
            rescale = tl.exp2(m - m_new)
            weight = tl.exp2(lse - m_new)
            acc = acc * rescale + o * weight
            total = total * rescale + weight
            m = m_new
    tl.store(
        o_ptr + b * stride_ob + h * stride_oh + dv,
        (acc / total).to(o_ptr.dtype.element_ty), mask=dv_mask,
    )


def decode_scratch(
    batch_size: int, num_heads: int, head_dim_v: int, num_kv_splits: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-split partial outputs (B, H, S, DV) and log-sum-exps (B, H, S), float32."""
    mid_o = torch.empty(
        (batch_size, num_heads, num_kv_splits, head_dim_v), dtype=torch.float32, device=device
    )
    mid_lse = torch.empty(
        (batch_size, num_heads, num_kv_splits), dtype=torch.float32, device=device
    )
    return mid_o, mid_lse


def merge_splits(
    mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor, seq_lens: torch.Tensor,
    sliding_window: int | None = None,
) -> None:
    """Stage 2: merges the splits of (B, H, S, DV) partials into out (B, H, DV)."""
    batch_size, num_heads, num_kv_splits, head_dim_v = mid_o.shape
    _merge_splits_kernel[(batch_size, num_heads)](
        mid_o, mid_lse, out, seq_lens, sliding_window or 0,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1), head_dim_v,
        NUM_SPLITS=num_kv_splits, BLOCK_DV=triton.next_power_of_2(head_dim_v),
        HAS_WINDOW=sliding_window is not None,
    )


def decode_attention(
    q: torch.Tensor, out: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
    scaling: float, num_kv_splits: int = 8,
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None, block_n: int = 32,
    sliding_window: int | None = None, logit_softcap: float | None = None,
    slot_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Writes attention of q (B, H, DK) over each request's pooled KV into out (B, H, DV).

    k_buffer (slots, H_kv, DK), v_buffer (slots, H_kv, DV): the layer's pool. ``scratch``:
    buffers from ``decode_scratch`` with at least B rows (shared by all layers of a batch).
    ``sliding_window``, ``logit_softcap``: the layer's (``AttentionLayer``); ``slot_map``
    (num_slots,): where the layer's buffers hold a request slot's K/V (None: at the slot).
    """
    if q.stride(-1) != 1:
        q = q.contiguous()
    batch_size, num_heads, head_dim_k = q.shape
    num_kv_heads, head_dim_v = k_buffer.shape[1], v_buffer.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    if batch_size == 0:
        return out
    if scratch is None:
        scratch = decode_scratch(batch_size, num_heads, head_dim_v, num_kv_splits, q.device)
    mid_o, mid_lse = scratch[0][:batch_size], scratch[1][:batch_size]
    if mid_o.shape[1:] != (num_heads, num_kv_splits, head_dim_v):
        raise ValueError(f"scratch {tuple(mid_o.shape)} does not fit this layer's heads/splits")
    kv_group = num_heads // num_kv_heads
    _decode_split_kernel[(batch_size, num_kv_heads, num_kv_splits)](
        q, k_buffer, v_buffer, mid_o, mid_lse,
        req_to_token, req_pool_indices, seq_lens,
        req_to_token if slot_map is None else slot_map,
        scaling * LOG2E, sliding_window or 0, logit_softcap or 0.0,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        kv_group, head_dim_k, head_dim_v,
        NUM_SPLITS=num_kv_splits,
        BLOCK_H=max(16, triton.next_power_of_2(kv_group)),
        BLOCK_N=block_n,
        BLOCK_DK=max(16, triton.next_power_of_2(head_dim_k)),
        BLOCK_DV=max(16, triton.next_power_of_2(head_dim_v)),
        DOT_PRECISION=dot_precision(q.dtype), HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=logit_softcap is not None, HAS_SLOT_MAP=slot_map is not None,
    )
    merge_splits(mid_o, mid_lse, out, seq_lens, sliding_window)
    return out
