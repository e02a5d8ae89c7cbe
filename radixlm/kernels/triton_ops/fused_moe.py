"""A fused mixture-of-experts kernel in Triton: routed SwiGLU experts as two grouped GEMMs.

    out[t] = sum_j w[t, j] * W2_e (silu(W1_e x_t) * W3_e x_t),   e = topk_ids[t, j]

The T k (token, expert) pairs are sorted by expert and each expert's run is padded to a
multiple of BLOCK_M (``align_pairs_by_expert``), so every tile of BLOCK_M rows belongs to
one expert and is one dense matmul against that expert's weights:

1. ``_gate_up_silu_kernel``, grid (tiles, I / BLOCK_N): rows gather their tokens' x, multiply
   by the expert's gate and up rows of ``w13`` (E, 2I, H) over H in BLOCK_K steps, and
   write ``silu(gate) * up`` (pairs, I);
2. ``_down_weighted_kernel``, grid (tiles, H / BLOCK_N): that activation times the expert's
   ``w2`` (E, H, I), scaled by the pair's router weight, written per pair (pairs, H);
3. the k pairs of each token are summed (T, H).

Shapes are data-independent (tiles are sized for the worst case, unused tiles exit at
once), so the whole computation is free of host syncs and CUDA-graph capturable.
``fused_experts`` satisfies ``radixlm.models.layers.moe_experts.ExpertsComputation``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm.kernels.triton_ops.extend_attention import dot_precision


def align_pairs_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair index per padded row, expert per tile) for T k pairs, tiles of ``block_m`` rows.

    Pair p is token ``p // k``'s ``p % k``-th choice. Rows of padding hold ``T k`` (out of
    range); tiles past the last used one have expert -1. Sizes: rows = tiles * block_m with
    tiles = ceil((T k + E (block_m - 1)) / block_m), the worst case over all routings.
    """
    device = topk_ids.device
    flat = topk_ids.reshape(-1)  # (P,) expert of each pair
    num_pairs = flat.numel()
    num_tiles = -(-(num_pairs + num_experts * (block_m - 1)) // block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # (E,)
    padded_start = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    expert_sorted = flat[order]
    rank = torch.arange(num_pairs, device=device) - start[expert_sorted]
    rows = torch.full((num_tiles * block_m,), num_pairs, dtype=torch.int64, device=device)
    rows[padded_start[expert_sorted] + rank] = order
    tile_end = torch.cumsum(padded // block_m, 0)  # (E,) one past each expert's last tile
    # Tile i belongs to the first expert whose tiles end after i; past the last: -1.
    tile_expert = torch.searchsorted(
        tile_end, torch.arange(num_tiles, device=device), right=True
    )
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, -1)
    return rows, tile_expert


@triton.jit
def _gate_up_silu_kernel(
    x_ptr, w13_ptr, act_ptr, rows_ptr, tile_expert_ptr,
    num_pairs, top_k, hidden, inter,
    stride_xt, stride_we, stride_wn, stride_at,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    block_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return
    pairs = tl.load(rows_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    tokens = pairs // top_k
    offs_n = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    w_base = w13_ptr + expert.to(tl.int64) * stride_we
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < hidden
        x = tl.load(
            x_ptr + tokens[:, None] * stride_xt + offs_k[None, :],
            mask=valid[:, None] & k_mask[None, :], other=0.0,
        )  # (M, K)
        w_mask = k_mask[:, None] & n_mask[None, :]
        w_gate = tl.load(
            w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=w_mask, other=0.0
        )  # (K, N)
        w_up = tl.load(
            w_base + (inter + offs_n)[None, :] * stride_wn + offs_k[:, None],
            mask=w_mask, other=0.0,
        )
        gate += tl.dot(x, w_gate, input_precision=DOT_PRECISION)
        up += tl.dot(x, w_up, input_precision=DOT_PRECISION)
    act = gate * tl.sigmoid(gate) * up
    tl.store(
        act_ptr + pairs[:, None] * stride_at + offs_n[None, :],
        act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :],
    )


@triton.jit
def _down_weighted_kernel(
    act_ptr, w2_ptr, out_ptr, weights_ptr, rows_ptr, tile_expert_ptr,
    num_pairs, hidden, inter,
    stride_at, stride_we, stride_wn, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    block_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return
    pairs = tl.load(rows_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    offs_n = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    w_base = w2_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < inter
        act = tl.load(
            act_ptr + pairs[:, None] * stride_at + offs_k[None, :],
            mask=valid[:, None] & k_mask[None, :], other=0.0,
        )  # (M, K)
        w = tl.load(
            w_base + offs_n[None, :] * stride_wn + offs_k[:, None],
            mask=k_mask[:, None] & n_mask[None, :], other=0.0,
        )  # (K, N)
        acc += tl.dot(act, w, input_precision=DOT_PRECISION)
    weight = tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    tl.store(
        out_ptr + pairs[:, None] * stride_ot + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :],
    )


def fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
) -> torch.Tensor:
    """x (T, H), w13 (E, 2I, H), w2 (E, H, I), topk_weights / topk_ids (T, k) -> (T, H).

    Tiles default to 64 x 64 x 32 on GPUs and 16 x 16 x 16 under the interpreter.
    """
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    if w2.shape != (num_experts, hidden, inter):
        raise ValueError(f"w2 {tuple(w2.shape)} does not match w13 {tuple(w13.shape)}")
    if num_tokens == 0:
        return torch.zeros_like(x)
    on_gpu = x.is_cuda
    block_m = block_m or (64 if on_gpu else 16)
    block_n = block_n or (64 if on_gpu else 16)
    block_k = block_k or (32 if on_gpu else 16)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    rows, tile_expert = align_pairs_by_expert(topk_ids, num_experts, block_m)
    weights = topk_weights.reshape(-1).contiguous()
    act = x.new_empty(num_pairs, inter)
    precision = dot_precision(x.dtype)
    _gate_up_silu_kernel[(len(tile_expert), triton.cdiv(inter, block_n))](
        x, w13, act, rows, tile_expert,
        num_pairs, top_k, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=precision,
    )
    out_pairs = x.new_empty(num_pairs, hidden)
    _down_weighted_kernel[(len(tile_expert), triton.cdiv(hidden, block_n))](
        act, w2, out_pairs, weights, rows, tile_expert,
        num_pairs, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), out_pairs.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=precision,
    )
    return out_pairs.view(num_tokens, top_k, hidden).sum(dim=1)
