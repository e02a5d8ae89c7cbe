"""Paged extend (prefill) attention in Triton: new tokens over their cached prefix and themselves.

Request b owns ``extend_lens[b]`` consecutive query rows starting at ``extend_starts[b]``.
Query i of request b sees the ``prefix_lens[b]`` cached keys, read from the pool through
the index table ``req_to_token[req_pool_indices[b]]``, then the new keys 0..i (causal),
read straight from the k and v passed in. Both phases feed one online softmax (FlashAttention,
Dao et al. 2022): a running maximum ``m``, a running denominator ``l`` and an unnormalized
accumulator, rescaled by ``exp2(m_old - m_new)`` whenever the maximum grows.

Grid: (request, query head, block of BLOCK_M queries). Query head h reads KV head
``h // (H / H_kv)`` (GQA; MQA when H_kv = 1). Keys may be wider than values (MLA's absorbed
form: key = latent + RoPE part, value = latent), so the key and value widths are separate.

Layers with a sliding window W (``window`` > 0) let the query at position i see keys j with
i - W < j <= i: each phase starts at the first key the block's first query sees, and keys
before a query's window are masked. A logit softcap c (``softcap`` > 0) turns each scaled
score s into c * tanh(s / c) before the mask. A layer whose pool holds its K/V under a slot
map (``slot_map``: request slot -> layer slot) reads its prefix through the map; the new
keys are read as computed, so a pool that drops keys falling out of the window never hides
one a query of this extend still sees.

Invariants: the kernel reads the pool and writes only ``out``; the new K/V must not have
to be in the pool yet (the prefix phase stops at ``prefix_lens[b]``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm.kernels.triton_ops import tile_plan

LOG2E = 1.4426950408889634  # for the host's arithmetic
# Kernels read only constexpr globals (a plain float compiles under the interpreter alone).
LOG2E_IN_KERNEL = tl.constexpr(LOG2E)
MASKED = tl.constexpr(-1.0e38)  # finite, so a fully masked block never produces inf - inf


@triton.jit
def online_softmax_step(scores, m_i, l_i, acc, v, DOT_PRECISION: tl.constexpr):
    """Folds one block of log2-scaled scores (M, N) and values (N, DV) into the state."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def scaled_scores(q, k, scale_log2, softcap, DOT_PRECISION: tl.constexpr,
                  HAS_SOFTCAP: tl.constexpr):
    """q k^T times the softmax scale, soft-capped where ``HAS_SOFTCAP``, in log2 units:
    (M, DK) @ (DK, N) -> (M, N). tanh(x) = 2 sigmoid(2x) - 1 (no tanh in every Triton)."""
    scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
    if HAS_SOFTCAP:
        capped = scores / (softcap * LOG2E_IN_KERNEL)
        scores = (2.0 * tl.sigmoid(2.0 * capped) - 1.0) * (softcap * LOG2E_IN_KERNEL)
    return scores


@triton.jit
def _extend_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, k_buf_ptr, v_buf_ptr,
    req_to_token_ptr, req_pool_indices_ptr, prefix_lens_ptr, extend_lens_ptr, extend_starts_ptr,
    slot_map_ptr, scale_log2, window, softcap,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_kbuf_slot, stride_kbuf_h, stride_vbuf_slot, stride_vbuf_h, stride_req_row,
    kv_group, head_dim_k, head_dim_v,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SLOT_MAP: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    block_m = tl.program_id(2)
    extend_len = tl.load(extend_lens_ptr + b).to(tl.int32)
    if block_m * BLOCK_M >= extend_len:
        return
    prefix_len = tl.load(prefix_lens_ptr + b).to(tl.int32)
    start = tl.load(extend_starts_ptr + b).to(tl.int64)
    row = tl.load(req_pool_indices_ptr + b).to(tl.int64)
    kv_h = h // kv_group

    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < extend_len
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    dk_mask = dk < head_dim_k
    dv_mask = dv < head_dim_v
    q = tl.load(
        q_ptr + (start + offs_m)[:, None] * stride_qt + h * stride_qh + dk[None, :],
        mask=m_mask[:, None] & dk_mask[None, :], other=0.0,
    )  # (M, DK)

    m_i = tl.full([BLOCK_M], MASKED, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    # Phase 1: the cached prefix, read through the index table (and the slot map).
    prefix_lo = 0
    if HAS_WINDOW:  # the first key the block's first query sees
        prefix_lo = tl.maximum(prefix_len + block_m * BLOCK_M - window + 1, 0)
    for n0 in range(prefix_lo, prefix_len, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < prefix_len
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
        visible = n_mask[None, :]
        if HAS_WINDOW:  # prefix key n, query m: n > prefix + m - window
            visible = visible & (offs_n[None, :] > prefix_len + offs_m[:, None] - window)
        scores = tl.where(visible, scores, MASKED)
        v = tl.load(
            v_buf_ptr + slots[:, None] * stride_vbuf_slot + kv_h * stride_vbuf_h + dv[None, :],
            mask=n_mask[:, None] & dv_mask[None, :], other=0.0,
        )  # (N, DV)
        m_i, l_i, acc = online_softmax_step(scores, m_i, l_i, acc, v, DOT_PRECISION)

    # Phase 2: the new tokens, causal; no key past this block's last query is needed.
    end = tl.minimum(extend_len, (block_m + 1) * BLOCK_M)
    new_lo = 0
    if HAS_WINDOW:
        new_lo = tl.maximum(block_m * BLOCK_M - window + 1, 0)
    for n0 in range(new_lo, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < extend_len
        k = tl.load(
            k_ptr + (start + offs_n)[None, :] * stride_kt + kv_h * stride_kh + dk[:, None],
            mask=n_mask[None, :] & dk_mask[:, None], other=0.0,
        )  # (DK, N)
        scores = scaled_scores(q, k, scale_log2, softcap, DOT_PRECISION, HAS_SOFTCAP)
        visible = n_mask[None, :] & (offs_n[None, :] <= offs_m[:, None])
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > offs_m[:, None] - window)
        scores = tl.where(visible, scores, MASKED)
        v = tl.load(
            v_ptr + (start + offs_n)[:, None] * stride_vt + kv_h * stride_vh + dv[None, :],
            mask=n_mask[:, None] & dv_mask[None, :], other=0.0,
        )  # (N, DV)
        m_i, l_i, acc = online_softmax_step(scores, m_i, l_i, acc, v, DOT_PRECISION)

    out = acc / l_i[:, None]
    tl.store(
        o_ptr + (start + offs_m)[:, None] * stride_ot + h * stride_oh + dv[None, :],
        out.to(o_ptr.dtype.element_ty), mask=m_mask[:, None] & dv_mask[None, :],
    )


def extend_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
    extend_starts: torch.Tensor, max_extend_len: int, scaling: float,
    block_m: int = 32, block_n: int = 32, sliding_window: int | None = None,
    logit_softcap: float | None = None, slot_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Writes attention of q (T, H, DK) into out (T, H, DV); returns out.

    k (T, H_kv, DK), v (T, H_kv, DV): the new tokens; k_buffer / v_buffer (slots, H_kv, DK/DV):
    the layer's pool; per request (B,): pool row, prefix and extend lengths, first query row.
    ``sliding_window``, ``logit_softcap``: the layer's (``AttentionLayer``); ``slot_map``
    (num_slots,): where the layer's buffers hold a request slot's K/V (None: at the slot).
    ``block_m`` / ``block_n`` are the largest tiles wanted: on a GPU they shrink to fit its
    shared memory (``tile_plan.extend_tiles``, which raises ValueError where nothing fits).
    """
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    num_heads, head_dim_k = q.shape[1], q.shape[2]
    num_kv_heads, head_dim_v = k.shape[1], v.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    batch_size = len(extend_lens)
    if batch_size == 0 or max_extend_len == 0:
        return out
    tiles = tile_plan.extend_tiles(head_dim_k, head_dim_v, q.dtype,
                                   tile_plan.shared_memory_per_block(q.device), block_m, block_n)
    block_m, block_n = tiles.block_m, tiles.block_n
    grid = (batch_size, num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_attention_kernel[grid](
        q, k, v, out, k_buffer, v_buffer,
        req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_starts,
        req_to_token if slot_map is None else slot_map, scaling * LOG2E,
        sliding_window or 0, logit_softcap or 0.0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        num_heads // num_kv_heads, head_dim_k, head_dim_v,
        BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_DK=tile_plan.padded(head_dim_k), BLOCK_DV=tile_plan.padded(head_dim_v),
        DOT_PRECISION=dot_precision(q.dtype), HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=logit_softcap is not None, HAS_SLOT_MAP=slot_map is not None,
        **tiles.launch_options(),
    )
    return out


def dot_precision(dtype: torch.dtype) -> str:
    """IEEE float32 products for float32 inputs (TF32 would miss the 1e-4 reference bound)."""
    return "ieee" if dtype == torch.float32 else "tf32"
