"""A Triton kernel that writes the new tokens' K and V into the paged KV pool.

One program per new token copies its (H_kv, D) key and value rows to slot
``out_cache_loc[t]`` of the layer's buffers. The source may be a strided view (models
slice k out of a fused qk tensor), the pool buffers are contiguous (slots, H_kv, D).

Invariants: only the rows at ``out_cache_loc`` change; ``out_cache_loc`` holds distinct
slots (the allocator never hands out a slot twice), so programs never race.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_buf_ptr, v_buf_ptr, loc_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_buf_slot, stride_buf_h,
    num_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, HAS_V: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)  # long chunks: offsets pass 2**31
    slot = tl.load(loc_ptr + t).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < head_dim)
    k = tl.load(
        k_ptr + t * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd,
        mask=mask,
    )
    dst = slot * stride_buf_slot + heads[:, None] * stride_buf_h + dims[None, :]
    tl.store(k_buf_ptr + dst, k.to(k_buf_ptr.dtype.element_ty), mask=mask)
    if HAS_V:
        v = tl.load(
            v_ptr + t * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd,
            mask=mask,
        )
        tl.store(v_buf_ptr + dst, v.to(v_buf_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor, v: torch.Tensor | None, k_buffer: torch.Tensor,
    v_buffer: torch.Tensor | None, out_cache_loc: torch.Tensor,
) -> None:
    """k, v: (T, H_kv, D), any strides; buffers: contiguous (slots, H_kv, D); loc: (T,).

    ``v`` and ``v_buffer`` None: a single-buffer pool (MLA's latent + RoPE key).
    """
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    has_v = v is not None
    if has_v and (v.shape != k.shape or v_buffer is None):
        raise ValueError(f"v {tuple(v.shape)} must match k {tuple(k.shape)} and have a buffer")
    if k_buffer.stride(2) != 1 or (has_v and v_buffer.stride() != k_buffer.stride()):
        raise ValueError("the KV pool buffers must be contiguous and laid out alike")
    v, v_buffer = (v, v_buffer) if has_v else (k, k_buffer)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_buffer, v_buffer, out_cache_loc,
        *k.stride(), *v.stride(),
        k_buffer.stride(0), k_buffer.stride(1),
        num_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        HAS_V=has_v,
    )
