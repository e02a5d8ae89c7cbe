"""Decode attention over shared prefixes (``shared_prefix_decode.py``): told that runs of
requests share their first slots, the torch-native backend reads those keys once per run,
and its output equals the plain decode path's (which reads every request's keys itself),
for grouped-query and latent (MLA) pools, runs of equal and of ragged lengths, and plain
requests before, between and after the runs."""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels.attention.torch_native_backend import TorchNativeAttentionBackend
from radixlm.kernels.forward_batch import ForwardBatch, ForwardMode
from radixlm.kv_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from radixlm.models.layers.attention import PagedAttention

SLOTS = 600
HEAD_DIM = 16
LATENT, ROPE = 12, 4


def decode_batch(lengths: list[int], runs: list[tuple[int, int, int]], pool, seed: int):
    """A decode batch of requests of ``lengths`` (KV already stored for all but the last
    token) whose rows share slots as ``runs`` say: the run's first request's first
    prefix-length slots are every member's."""
    gen = torch.Generator().manual_seed(seed)
    # Distinct slots everywhere, then each run's members take its first member's prefix.
    shape = (len(lengths), max(lengths))
    table = torch.randperm(SLOTS - 1, generator=gen)[: shape[0] * shape[1]].view(shape) + 1
    for start, count, prefix in runs:
        table[start + 1 : start + count, :prefix] = table[start, :prefix]
    positions = torch.tensor(lengths) - 1
    rows = torch.arange(len(lengths))
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=torch.zeros(len(lengths), dtype=torch.int64),
        positions=positions,
        out_cache_loc=table[rows, positions],
        req_pool_indices=rows,
        seq_lens=positions + 1,
        prefix_lens=positions,
        extend_seq_lens=torch.ones_like(positions),
        req_to_token=table,
        kv_pool=pool,
        attn_backend=TorchNativeAttentionBackend(),
        seq_lens_list=list(lengths),
        extend_seq_lens_list=[1] * len(lengths),
        shared_prefixes=runs,
    )


def attend(batch: ForwardBatch, q, k, v, layer, shared: bool) -> torch.Tensor:
    if not shared:
        batch.shared_prefixes = []
    backend = batch.attn_backend
    backend.init_forward_metadata(batch)
    return backend.forward(q, k, v, layer, batch)


LAYOUTS = {
    # lengths, runs (first request, count, prefix length)
    "one_run_of_equal_beams": ([40] * 8, [(0, 8, 33)]),
    "runs_between_plain_requests": ([9, 30, 30, 30, 17, 25, 25], [(1, 3, 21), (5, 2, 24)]),
    "ragged_run": ([27, 35, 31, 40, 12], [(0, 4, 20)]),
    "a_run_sharing_nothing_is_left_plain": ([14, 14, 22], [(0, 2, 0)]),
}


@pytest.mark.parametrize("kv_heads,heads", [(2, 2), (2, 8)])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_shared_prefix_decode_equals_the_plain_path(layout, kv_heads, heads):
    lengths, runs = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(3)
    pool = MHATokenToKVPool(SLOTS, 2, kv_heads, HEAD_DIM, torch.float32, "cpu")
    for buffer in pool.layer_buffers():
        buffer.normal_(generator=gen)
    q = torch.randn(len(lengths), heads, HEAD_DIM, generator=gen)
    k = torch.randn(len(lengths), kv_heads, HEAD_DIM, generator=gen)
    v = torch.randn(len(lengths), kv_heads, HEAD_DIM, generator=gen)
    layer = PagedAttention(1, heads, kv_heads, HEAD_DIM, 0.25)
    plain = attend(decode_batch(lengths, runs, pool, seed=5), q, k, v, layer, shared=False)
    batch = decode_batch(lengths, runs, pool, seed=5)
    shared = attend(batch, q, k, v, layer, shared=True)
    planned = batch.attn_backend._layout.shared
    assert (planned is None) == all(prefix == 0 for _, _, prefix in runs)
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5)


def test_latent_pool_reads_its_values_from_the_shared_keys():
    """MLA: one KV head of latent + RoPE rows, the values the latent part of them."""
    lengths, runs = LAYOUTS["runs_between_plain_requests"]
    gen = torch.Generator().manual_seed(4)
    pool = MLATokenToKVPool(SLOTS, 2, LATENT, ROPE, torch.float32, "cpu")
    for buffer in pool.kv_buffers:
        buffer.normal_(generator=gen)
    q = torch.randn(len(lengths), 4, LATENT + ROPE, generator=gen)
    k = torch.randn(len(lengths), 1, LATENT + ROPE, generator=gen)
    layer = PagedAttention(1, 4, 1, LATENT + ROPE, 0.3, v_head_dim=LATENT)
    plain = attend(decode_batch(lengths, runs, pool, 6), q, k, k[..., :LATENT], layer, False)
    shared = attend(decode_batch(lengths, runs, pool, 6), q, k, k[..., :LATENT], layer, True)
    assert shared.shape == (len(lengths), 4, LATENT)
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5)
