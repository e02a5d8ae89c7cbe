"""Batches and a float64 reference for the sliding-window / soft-cap / slot-map tests.

``reference`` computes each query's masked softmax explicitly, one query and head at a
time, from the K/V the test put in the pool (read through ``req_to_token`` and, for a
mapped layer, the test's own slot map) and the new tokens' k, v. ``MappedPool`` is an
``MHATokenToKVPool`` whose layer ``MAPPED_LAYER`` holds its K/V under a slot map, the
contract of ``slot_map_for``: keys out of every request's window are dropped (mapped to 0,
padding) and the rest sit at a permutation of the slots; ``set_kv`` maps the request's
slots itself.
"""

from __future__ import annotations

import torch
from paged_cases import PagedCase, random_paged_batch

from radixlm.kernels.forward_batch import ForwardMode
from radixlm.kv_cache.memory_pool import MHATokenToKVPool

KV_HEADS = 2
HEAD_DIM = 16
MAPPED_LAYER = 1


class MappedPool(MHATokenToKVPool):
    """Layer ``MAPPED_LAYER``'s K/V under ``slot_map``; the other layer's at the slots."""

    slot_map: torch.Tensor

    def slot_map_for(self, layer_id: int) -> torch.Tensor | None:
        return self.slot_map if layer_id == MAPPED_LAYER else None

    def set_kv(self, layer_id, slots, k, v) -> None:
        mapped = self.slot_map_for(layer_id)
        super().set_kv(layer_id, slots if mapped is None else mapped[slots], k, v)


def map_pool(case: PagedCase, window: int | None, seed: int, page: int = 1) -> MappedPool:
    """Turns the case's pool into a ``MappedPool``: the mapped layer's prefix K/V move to
    their mapped slots (those out of the first query's window are dropped, in whole pages
    of ``page`` slots), and garbage fills every slot the map does not reach from a visible
    key. Pages map to pages offset for offset (a hybrid pool's invariant)."""
    gen = torch.Generator().manual_seed(seed)
    pool = case.batch.kv_pool
    mapped = MappedPool.__new__(MappedPool)
    mapped.__dict__.update(pool.__dict__)
    num_pages = pool.num_slots // page
    page_map = torch.zeros(num_pages, dtype=torch.int64)
    page_map[1:] = torch.randperm(num_pages - 1, generator=gen) + 1
    batch = case.batch
    old_k, old_v = pool.k_buffers[MAPPED_LAYER], pool.v_buffers[MAPPED_LAYER]
    slot_map = (page_map[:, None] * page + torch.arange(page)).flatten().to(old_k.device)
    new_k, new_v = (torch.randn(old.shape, generator=gen).to(old.device, old.dtype)
                    for old in (old_k, old_v))
    for b, row in enumerate(batch.req_pool_indices.tolist()):
        seq, new = batch.seq_lens_list[b], batch.extend_seq_lens_list[b]
        first = 0 if window is None else max(0, seq - new + 1 - window) // page * page
        slots = batch.req_to_token[row, :seq]
        slot_map[slots[:first]] = 0  # dropped: out of the window of all its queries
        kept = slots[first : seq - new]
        new_k[slot_map[kept]] = old_k[kept]
        new_v[slot_map[kept]] = old_v[kept]
    mapped.slot_map = slot_map
    mapped.k_buffers = list(pool.k_buffers)
    mapped.v_buffers = list(pool.v_buffers)
    mapped.k_buffers[MAPPED_LAYER], mapped.v_buffers[MAPPED_LAYER] = new_k, new_v
    batch.kv_pool = mapped
    return mapped


def windowed_case(mode: ForwardMode, prefix_lens: list[int], extend_lens: list[int],
                  num_heads: int, page_size: int = 1, seed: int = 3,
                  device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                  head_dim: int = HEAD_DIM) -> PagedCase:
    return random_paged_batch(mode, prefix_lens, extend_lens, num_heads, KV_HEADS, head_dim,
                              page_size, seed, device, dtype)


def prefix_kv(case: PagedCase, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each request's cached (keys, values) (S_prefix, H_kv, D) as the pool holds them now,
    read through the slot map where the layer has one (dropped keys: zeros)."""
    batch, pool = case.batch, case.batch.kv_pool
    slot_map = pool.slot_map_for(layer)
    out = []
    for b, row in enumerate(batch.req_pool_indices.tolist()):
        prefix = batch.seq_lens_list[b] - batch.extend_seq_lens_list[b]
        slots = batch.req_to_token[row, :prefix]
        if slot_map is not None:
            slots = slot_map[slots]
        keys, values = pool.k_buffers[layer][slots].clone(), pool.v_buffers[layer][slots].clone()
        keys[slots == 0] = 0  # a dropped key must not be read: zeros here, garbage in the pool
        values[slots == 0] = 0
        out.append((keys, values))
    return out


def reference(case: PagedCase, prefixes, scale: float, window: int | None,
              softcap: float | None) -> torch.Tensor:
    """(T, H, D) in float64: query i of request b over keys j with pos - W < j <= pos,
    pos = prefix_b + i, scores = c * tanh(q k * scale / c)."""
    batch, q = case.batch, case.q.double()
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    start = 0
    for b, (pk, pv) in enumerate(prefixes):
        new = batch.extend_seq_lens_list[b]
        rows = slice(start, start + new)
        start += new
        keys = torch.cat([pk, case.k[rows]]).double()  # (S, H_kv, D)
        values = torch.cat([pv, case.v[rows]]).double()
        group = q.shape[1] // keys.shape[1]
        prefix = len(pk)
        for i in range(new):
            pos = prefix + i
            lo = 0 if window is None else max(0, pos - window + 1)
            for h in range(q.shape[1]):
                scores = keys[lo : pos + 1, h // group] @ q[rows][i, h] * scale
                if softcap is not None:
                    scores = softcap * torch.tanh(scores / softcap)
                out[rows][i, h] = torch.softmax(scores, 0) @ values[lo : pos + 1, h // group]
    return out
