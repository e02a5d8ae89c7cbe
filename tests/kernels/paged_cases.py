"""Random paged batches for the attention-kernel tests: ragged requests over a shuffled pool.

Each batch scatters its requests' pages over random pool pages (in page order within a
request, as the allocator does), puts the requests in random rows of ``req_to_token``,
fills every other slot and index with garbage, and gives the new tokens random q, k, v.
The torch-native backend over the same batch is the reference (``torch_native_reference``),
run on a copy of the pool so the kernel under test writes into its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.kernels.attention.torch_native_backend import TorchNativeAttentionBackend
from radixlm.kernels.forward_batch import ForwardBatch, ForwardMode
from radixlm.kv_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool

NUM_LAYERS = 2
MAX_ROWS = 8
MAX_CONTEXT = 96


@dataclass
class PagedCase:
    batch: ForwardBatch
    q: torch.Tensor  # (T, H, D)
    k: torch.Tensor  # (T, H_kv, D)
    v: torch.Tensor  # (T, H_kv, D)


def random_paged_batch(
    mode: ForwardMode, prefix_lens: list[int], extend_lens: list[int], num_heads: int,
    num_kv_heads: int, head_dim: int, page_size: int, seed: int,
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
    max_context: int = MAX_CONTEXT,
) -> PagedCase:
    """A batch on ``device`` (pool, tables and q, k, v in ``dtype``), drawn on the CPU from
    ``seed``: the same values on any device. Sequences may be up to ``max_context`` long."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    pages_needed = sum(-(-n // page_size) for n in seq_lens)
    num_pages = pages_needed + 4  # a few spare pages, plus the reserved page 0
    pool = MHATokenToKVPool(
        (num_pages + 1) * page_size, NUM_LAYERS, num_kv_heads, head_dim, dtype, device
    )
    for layer in range(NUM_LAYERS):
        for buffer in (pool.k_buffers[layer], pool.v_buffers[layer]):
            buffer.copy_(torch.randn(buffer.shape, generator=gen))
    rows = ReqToTokenPool(MAX_ROWS, max_context, device)
    table = torch.randint(0, pool.num_slots, (MAX_ROWS, max_context), generator=gen)
    free_pages = (torch.randperm(num_pages, generator=gen) + 1).tolist()
    row_ids = torch.randperm(MAX_ROWS, generator=gen)[: len(seq_lens)].tolist()
    out_cache_loc = []
    for row, seq_len, prefix in zip(row_ids, seq_lens, prefix_lens, strict=True):
        pages = [free_pages.pop() for _ in range(-(-seq_len // page_size))]
        slots = torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in pages])
        table[row, :seq_len] = slots[:seq_len]
        out_cache_loc.append(slots[prefix:seq_len])
    rows.req_to_token.copy_(table)

    total = sum(extend_lens)
    q, k, v = (torch.randn(total, heads, head_dim, generator=gen).to(device, dtype)
               for heads in (num_heads, num_kv_heads, num_kv_heads))

    def as_tensor(values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    positions = [p + i for p, e in zip(prefix_lens, extend_lens, strict=True) for i in range(e)]
    batch = ForwardBatch(
        mode=mode,
        input_ids=torch.zeros(total, dtype=torch.int64, device=device),
        positions=as_tensor(positions),
        out_cache_loc=torch.cat(out_cache_loc).to(device),
        req_pool_indices=as_tensor(row_ids),
        seq_lens=as_tensor(seq_lens),
        prefix_lens=as_tensor(prefix_lens),
        extend_seq_lens=as_tensor(extend_lens),
        req_to_token=rows.req_to_token,
        kv_pool=pool,
        attn_backend=TorchNativeAttentionBackend(),
        seq_lens_list=seq_lens,
        extend_seq_lens_list=list(extend_lens),
    )
    return PagedCase(batch, q, k, v)


def random_lengths(
    mode: ForwardMode, batch_size: int, max_prefix: int, max_extend: int, seed: int
) -> tuple[list[int], list[int]]:
    """Ragged prefix and extend lengths (decode: one new token, a prefix of at least 0)."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, max_prefix + 1, (batch_size,), generator=gen).tolist()
    if mode is ForwardMode.DECODE:
        return prefix, [1] * batch_size
    return prefix, torch.randint(1, max_extend + 1, (batch_size,), generator=gen).tolist()


def clone_pool(pool: MHATokenToKVPool) -> MHATokenToKVPool:
    """A deep copy, so the reference and the kernel each write into their own pool."""
    copy = MHATokenToKVPool.__new__(MHATokenToKVPool)
    copy.__dict__.update(pool.__dict__)
    copy.k_buffers = [b.clone() for b in pool.k_buffers]
    copy.v_buffers = [b.clone() for b in pool.v_buffers]
    return copy


def random_latent_pool(num_slots: int, latent_dim: int, rope_dim: int, dtype: torch.dtype,
                       device: torch.device | str, seed: int) -> MLATokenToKVPool:
    """An MLA pool of ``NUM_LAYERS`` layers of random [c_kv : D_l | k_rope : D_r] rows, drawn
    on the CPU from ``seed``: the same values on any device."""
    pool = MLATokenToKVPool(num_slots, NUM_LAYERS, latent_dim, rope_dim, dtype, device)
    gen = torch.Generator().manual_seed(seed)
    for buffer in pool.kv_buffers:
        buffer.copy_(torch.randn(buffer.shape, generator=gen))
    return pool


def clone_latent_pool(pool: MLATokenToKVPool) -> MLATokenToKVPool:
    """A deep copy of an MLA pool, as ``clone_pool``."""
    copy = MLATokenToKVPool.__new__(MLATokenToKVPool)
    copy.__dict__.update(pool.__dict__)
    copy.kv_buffers = [b.clone() for b in pool.kv_buffers]
    return copy


def torch_native_reference(case: PagedCase, v: torch.Tensor, layer
                           ) -> tuple[torch.Tensor, MHATokenToKVPool | MLATokenToKVPool]:
    """The torch-native output of ``layer`` over ``case`` (with values ``v``), computed on a
    copy of the batch's pool, and that copy (holding the k and v the reference stored).
    ``case.batch`` keeps its own pool, untouched, for the kernel under test."""
    batch = case.batch
    pool = batch.kv_pool
    copy = clone_latent_pool(pool) if isinstance(pool, MLATokenToKVPool) else clone_pool(pool)
    batch.kv_pool = copy
    try:
        reference = TorchNativeAttentionBackend()
        reference.init_forward_metadata(batch)
        expected = reference.forward(case.q, case.k, v, layer, batch)
    finally:
        batch.kv_pool = pool
    return expected, copy
