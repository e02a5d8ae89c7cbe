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

Invariants: the kernel reads the pool and writes only ``out``; the new K/V must not have
to be in the pool yet (the prefix phase stops at ``prefix_lens[b]``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
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
def _extend_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, k_buf_ptr, v_buf_ptr,
    req_to_token_ptr, req_pool_indices_ptr, prefix_lens_ptr, extend_lens_ptr, extend_starts_ptr,
    scale_log2,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_kbuf_slot, stride_kbuf_h, stride_vbuf_slot, stride_vbuf_h, stride_req_row,
    kv_group, head_dim_k, head_dim_v,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_PRECISION: tl.constexpr,
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

    # Phase 1: the cached prefix, every key visible, read through the index table.
    for n0 in range(0, prefix_len, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < prefix_len
        slots = tl.load(
            req_to_token_ptr + row * stride_req_row + offs_n, mask=n_mask, other=0
        ).to(tl.int64)
        k = tl.load(
            k_buf_ptr + slots[None, :] * stride_kbuf_slot + kv_h * stride_kbuf_h + dk[:, None],
            mask=n_mask[None, :] & dk_mask[:, None], other=0.0,
        )  # (DK, N)
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        scores = tl.where(n_mask[None, :], scores, MASKED)
        v = tl.load(
            v_buf_ptr + slots[:, None] * stride_vbuf_slot + kv_h * stride_vbuf_h + dv[None, :],
            mask=n_mask[:, None] & dv_mask[None, :], other=0.0,
        )  # (N, DV)
        m_i, l_i, acc = online_softmax_step(scores, m_i, l_i, acc, v, DOT_PRECISION)

    # Phase 2: the new tokens, causal; no key past this block's last query is needed.
    end = tl.minimum(extend_len, (block_m + 1) * BLOCK_M)
    for n0 in range(0, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < extend_len
        k = tl.load(
            k_ptr + (start + offs_n)[None, :] * stride_kt + kv_h * stride_kh + dk[:, None],
            mask=n_mask[None, :] & dk_mask[:, None], other=0.0,
        )  # (DK, N)
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        visible = n_mask[None, :] & (offs_n[None, :] <= offs_m[:, None])
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
    block_m: int = 32, block_n: int = 32,
) -> torch.Tensor:
    """Writes attention of q (T, H, DK) into out (T, H, DV); returns out.

    k (T, H_kv, DK), v (T, H_kv, DV): the new tokens; k_buffer / v_buffer (slots, H_kv, DK/DV):
    the layer's pool; per request (B,): pool row, prefix and extend lengths, first query row.
    """
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    num_heads, head_dim_k = q.shape[1], q.shape[2]
    num_kv_heads, head_dim_v = k.shape[1], v.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    batch_size = len(extend_lens)
    if batch_size == 0 or max_extend_len == 0:
        return out
    block_dk = max(16, triton.next_power_of_2(head_dim_k))
    block_dv = max(16, triton.next_power_of_2(head_dim_v))
    if block_dk + block_dv > 512:
        # MLA's 576 / 512-wide heads: 64-row tiles overflow an sm_90's shared memory in
        # bfloat16 (32-row tiles take 128 KB). In float32 even 16-row tiles do not fit: MLA
        # prefill on GPUs needs a 16-bit dtype (or keys split into latent and RoPE parts).
        block_m, block_n = min(block_m, 32), min(block_n, 32)
    grid = (batch_size, num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_attention_kernel[grid](
        q, k, v, out, k_buffer, v_buffer,
        req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_starts,
        scaling * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        num_heads // num_kv_heads, head_dim_k, head_dim_v,
        BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_DK=block_dk, BLOCK_DV=block_dv,
        DOT_PRECISION=dot_precision(q.dtype),
    )
    return out


def dot_precision(dtype: torch.dtype) -> str:
    """IEEE float32 products for float32 inputs (TF32 would miss the 1e-4 reference bound)."""
    return "ieee" if dtype == torch.float32 else "tf32"
