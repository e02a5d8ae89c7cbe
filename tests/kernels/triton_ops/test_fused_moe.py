"""The fused MoE Triton kernel against the MoE layer's torch computations (float32, CPU
interpreter, or the GPU: ``KERNEL_DEVICE``): random routings with idle and crowded experts,
ragged token counts, an intermediate size that is not a multiple of the tiles, and the MoE layer
end to end."""

from __future__ import annotations

import pytest
import torch
from kernel_device import KERNEL_DEVICE

from radixlm.kernels.triton_ops.fused_moe import align_pairs_by_expert, fused_experts
from radixlm.models.layers.moe_experts import (
    StackedExperts,
    grouped_experts_torch,
    naive_experts_per_token,
)

pytestmark = pytest.mark.triton

HIDDEN = 32
INTER = 24  # not a multiple of the 16-wide tiles


def on_kernel_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(KERNEL_DEVICE) for t in tensors]


def random_experts(num_experts: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * INTER, HIDDEN, generator=gen) * 0.2
    w2 = torch.randn(num_experts, HIDDEN, INTER, generator=gen) * 0.2
    return w13, w2, gen


def random_routing(num_tokens: int, num_experts: int, top_k: int, gen, crowd: bool = False):
    """Distinct experts per token; ``crowd`` sends most tokens to experts 0 and 1."""
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    if crowd:
        scores[:, :2] += 1.0
    topk_weights, topk_ids = torch.softmax(scores, -1).topk(top_k, dim=-1)
    return topk_weights, topk_ids


@pytest.mark.parametrize(
    "num_tokens, num_experts, top_k, crowd",
    [(1, 8, 2, False), (7, 8, 2, False), (40, 8, 2, True), (19, 4, 1, False), (12, 16, 6, False)],
    ids=["one_token", "ragged", "crowded_experts", "top1", "top6_of_16"],
)
def test_fused_experts_match_the_torch_experts(num_tokens, num_experts, top_k, crowd):
    w13, w2, gen = random_experts(num_experts, seed=num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    topk_weights, topk_ids = random_routing(num_tokens, num_experts, top_k, gen, crowd)
    expected = naive_experts_per_token(x, w13, w2, topk_weights, topk_ids)
    out = fused_experts(*on_kernel_device(x, w13, w2, topk_weights, topk_ids))
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.cpu(), expected, atol=1e-4, rtol=1e-4)


def test_the_moe_layer_gives_the_same_output_with_the_fused_kernel():
    w13, w2, gen = random_experts(8, seed=5)
    experts = StackedExperts(8, HIDDEN, INTER).to(KERNEL_DEVICE)
    with torch.no_grad():
        experts.w13.copy_(w13)
        experts.w2.copy_(w2)
    x = torch.randn(23, HIDDEN, generator=gen)
    topk_weights, topk_ids = random_routing(23, 8, 2, gen)
    x, topk_weights, topk_ids = on_kernel_device(x, topk_weights, topk_ids)
    with torch.inference_mode():
        expected = experts(x, topk_weights, topk_ids)
        experts.computation = fused_experts
        out = experts(x, topk_weights, topk_ids)
    w13, w2 = on_kernel_device(w13, w2)
    torch.testing.assert_close(expected, grouped_experts_torch(x, w13, w2, topk_weights, topk_ids))
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_no_tokens_give_an_empty_output():
    w13, w2, _ = random_experts(4, seed=0)
    empty = torch.empty(0, 2, dtype=torch.int64)
    out = fused_experts(*on_kernel_device(torch.empty(0, HIDDEN), w13, w2, torch.empty(0, 2),
                                          empty))
    assert out.shape == (0, HIDDEN)


def test_alignment_puts_each_experts_pairs_in_whole_tiles():
    gen = torch.Generator().manual_seed(1)
    _, topk_ids = random_routing(30, 8, 2, gen, crowd=True)
    block_m = 4
    rows, tile_expert = align_pairs_by_expert(topk_ids, 8, block_m)
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    assert len(rows) == len(tile_expert) * block_m
    real = rows[rows < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair exactly once
    for tile, expert in enumerate(tile_expert.tolist()):
        tile_rows = rows[tile * block_m : (tile + 1) * block_m]
        tile_pairs = tile_rows[tile_rows < num_pairs]
        if expert < 0:
            assert len(tile_pairs) == 0
        else:
            assert len(tile_pairs) > 0 and bool((flat[tile_pairs] == expert).all())
