"""Attention in plain PyTorch for layers the torch-native backend's fast paths do not serve:
a sliding window, logit soft-capping, or K/V held under a slot map of the pool's own.

The fast paths (``torch_native_backend.py``) assume every key from 0 up to the query is
visible, that SDPA computes the scores, and that a layer's K/V lie at the request's slots.
A layer with ``sliding_window`` W (query at position i sees keys j with i - W < j <= i),
``logit_softcap`` c (scores = c * tanh(scores / c) after scaling, before the mask) or a
``kv_pool.slot_map_for(layer_id)`` comes here instead, prefill, extend and decode alike:

- one padded (B, Q, S) grid a batch, as the backend's padded layout, except that request
  b's keys start at its first query's window, ``first_b = max(0, prefix_b + 1 - W)``, so a
  decode step at a long context reads W keys, not all of them;
- keys of the cached prefix are read from the layer's buffers at the request's slots taken
  through the slot map; the new tokens' K/V are used as computed (copied into the grid),
  so nothing depends on whether the pool keeps a new token that falls out of the window
  within the same extend;
- the mask is additive (0 or -inf): causal, windowed, and past each request's keys; a key
  whose slot the map took to 0 (dropped) is out of every query's window, so it is masked;
- a decode step, where the fused CPU kernels are on, attends over the keys where they lie
  in the pool (``paged_decode_attention``, which soft-caps) through the layout's table,
  which holds only the window's keys: the kernel reads W keys a request, no gather;
- otherwise, without a softcap one SDPA call attends the grid; with one the scores are computed
  explicitly in float32, in chunks of ``QUERY_CHUNK`` query rows, so the scores of a long
  prompt over all its keys (a global layer of Gemma 2) do not take B * H * Q * S floats.

What a batch needs is built once a batch per distinct (window, slot map), when the first
layer of that kind asks, and shared by all layers of the kind: the slot table at once, the
grid (mask, where its queries and new keys sit) only where a path other than the fused
decode kernel asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from radixlm.kernels.attention.attention_backend import LayerDecodeTables
from radixlm.kernels.attention.attention_layer import AttentionLayer
from radixlm.kernels.cpu_ops import fused_ops
from radixlm.kernels.forward_batch import ForwardBatch, ForwardMode

QUERY_CHUNK = 256
"""Query rows of the grid a soft-capped layer scores at once."""


def needs_windowed_path(layer: AttentionLayer, fb: ForwardBatch) -> bool:
    """Whether ``layer`` is one the fast paths would mis-serve (see the module docstring)."""
    return (getattr(layer, "sliding_window", None) is not None
            or getattr(layer, "logit_softcap", None) is not None
            or fb.kv_pool.slot_map_for(layer.layer_id) is not None)


@dataclass
class WindowedGrid:
    """The padded grid of a batch for one (window, slot map), beside its ``WindowedLayout``:
    B requests, Q query rows, S key columns (what the paths other than the fused decode
    kernel need)."""

    new_rows: torch.Tensor  # (T,) the flattened (B * S) key row of each new token
    query_rows: torch.Tensor | None  # (T,) each new token's (B * Q) grid row; None: B * Q = T
    visible: torch.Tensor  # (B, 1, Q, S) bool
    batch_size: int
    max_queries: int
    _additive: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    def mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The additive (B, 1, Q, S) mask in ``dtype``: 0 where visible, -inf elsewhere."""
        mask = self._additive.get(dtype)
        if mask is None:
            mask = torch.zeros(self.visible.shape, dtype=dtype, device=self.visible.device)
            mask.masked_fill_(~self.visible, float("-inf"))
            self._additive[dtype] = mask
        return mask


@dataclass
class WindowedLayout:
    """One (window, slot map)'s keys of a batch: what the fused decode kernel reads, and the
    grid the other paths attend in, built on first use (``grid``)."""

    kv_slots: torch.Tensor  # (B, S) the layer-buffer slot of key column j of request b
    key_lens: torch.Tensor  # (B,) the key columns of request b that hold its keys
    columns: torch.Tensor  # (B, S) the position of key column j of request b
    first: torch.Tensor  # (B,) the position of each request's first key column
    window: int | None
    fb: ForwardBatch
    _grid: WindowedGrid | None = None

    def grid(self) -> WindowedGrid:
        if self._grid is None:
            self._grid = build_grid(self)
        return self._grid


def build_layout(fb: ForwardBatch, window: int | None,
                 slot_map: torch.Tensor | None) -> WindowedLayout:
    """The keys of batch ``fb`` for layers with ``window`` (None: unbounded) whose buffers
    are indexed through ``slot_map`` (None: by the request's slots)."""
    device = fb.input_ids.device
    seq_host, ext_host = fb.seq_lens_list, fb.extend_seq_lens_list
    first_host = [0 if window is None else max(0, s - e + 1 - window)
                  for s, e in zip(seq_host, ext_host)]
    num_keys = max(s - f for s, f in zip(seq_host, first_host))
    first = torch.tensor(first_host, dtype=torch.int64, device=device)
    columns = first[:, None] + torch.arange(num_keys, device=device)[None, :]  # (B, S) positions
    max_kv = max(seq_host)
    rows = fb.req_to_token[fb.req_pool_indices, :max_kv]  # (B, max_kv)
    kv_slots = rows.gather(1, columns.clamp(max=max_kv - 1))  # past a request's keys: masked
    if slot_map is not None:
        kv_slots = slot_map[kv_slots]
    return WindowedLayout(kv_slots, fb.seq_lens - first, columns, first, window, fb)


def build_grid(layout: WindowedLayout) -> WindowedGrid:
    """``layout``'s padded grid: the mask and where the new tokens' queries and keys sit."""
    fb, columns, window = layout.fb, layout.columns, layout.window
    device = columns.device
    ext_host = fb.extend_seq_lens_list
    batch_size, max_q, num_keys = len(ext_host), max(ext_host), columns.shape[1]
    i = torch.arange(max_q, device=device)
    # Padded query rows repeat the request's last query, so no row is fully masked.
    positions = fb.prefix_lens[:, None] + torch.minimum(
        i[None, :], (fb.extend_seq_lens - 1)[:, None])  # (B, Q)
    visible = columns[:, None, :] <= positions[:, :, None]  # (B, Q, S): causal
    if window is not None:
        visible &= columns[:, None, :] > positions[:, :, None] - window

    starts = torch.cumsum(fb.extend_seq_lens, 0) - fb.extend_seq_lens
    req_of_token = torch.repeat_interleave(
        torch.arange(batch_size, device=device), fb.extend_seq_lens)  # (T,)
    offset_in_req = torch.arange(len(fb.input_ids), device=device) - starts[req_of_token]
    new_rows = (req_of_token * num_keys + (fb.prefix_lens - layout.first)[req_of_token]
                + offset_in_req)
    query_rows = None if sum(ext_host) == batch_size * max_q else (
        req_of_token * max_q + offset_in_req)
    return WindowedGrid(new_rows, query_rows, visible.unsqueeze(1), batch_size, max_q)


class WindowedAttention:
    """A batch's attention for windowed, soft-capped or slot-mapped layers; made per batch
    by the backend, its layouts built on first use (``build_layout``)."""

    def __init__(self, forward_batch: ForwardBatch) -> None:
        self._fb = forward_batch
        self._layouts: dict[tuple[int | None, int], tuple[torch.Tensor | None,
                                                          WindowedLayout]] = {}
        self._maps_slots: bool | None = None
        self._writes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def pool_maps_slots(self) -> bool:
        """Whether the batch's pool holds any layer's K/V under a slot map of its own."""
        if self._maps_slots is None:
            pool = self._fb.kv_pool
            num_layers = len(pool.layer_buffers()) // (1 if pool.values_view_keys else 2)
            self._maps_slots = any(pool.slot_map_for(layer) is not None
                                   for layer in range(num_layers))
        return self._maps_slots

    def layout(self, window: int | None, slot_map: torch.Tensor | None) -> WindowedLayout:
        key = (window, id(slot_map))
        known = self._layouts.get(key)
        if known is None or known[0] is not slot_map:  # an id reused by another map
            known = (slot_map, build_layout(self._fb, window, slot_map))
            self._layouts[key] = known
        return known[1]

    def decode_tables(self, layer: AttentionLayer) -> LayerDecodeTables:
        """What ``forward`` stores a decode step's K/V at and attends with on the fused
        kernels: the request slots through the layer's slot map, its window's keys."""
        fb = self._fb
        slot_map = fb.kv_pool.slot_map_for(layer.layer_id)
        layout = self.layout(layer.sliding_window, slot_map)
        writes = fb.out_cache_loc if slot_map is None else self._mapped_writes(slot_map)
        return LayerDecodeTables(writes, layout.kv_slots, layout.key_lens,
                                 layer.logit_softcap or 0.0)

    def _mapped_writes(self, slot_map: torch.Tensor) -> torch.Tensor:
        """The batch's new tokens' slots through ``slot_map``, taken once a batch a map."""
        known = self._writes.get(id(slot_map))
        if known is None or known[0] is not slot_map:
            known = (slot_map, slot_map[self._fb.out_cache_loc])
            self._writes[id(slot_map)] = known
        return known[1]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: AttentionLayer) -> torch.Tensor:
        """Stores the new K/V (through the pool's ``set_kv``), then attends: q (T, H, D),
        k (T, H_kv, D), v (T, H_kv, D_v) -> (T, H, D_v)."""
        fb, pool = self._fb, self._fb.kv_pool
        pool.set_kv(layer.layer_id, fb.out_cache_loc, k, v)
        layout = self.layout(layer.sliding_window, pool.slot_map_for(layer.layer_id))
        kernels = fused_ops.for_tensor(q)
        if fb.mode is ForwardMode.DECODE and kernels is not None:
            k_buffer, v_buffer = pool.get_kv(layer.layer_id)  # the new K/V among them
            return kernels.paged_decode_attention(q, k_buffer, v_buffer, layout.kv_slots,
                                                  layout.key_lens, layer.scaling,
                                                  layer.logit_softcap or 0.0)
        grid = layout.grid()
        keys, values = self._grid_kv(k, v, layer, layout.kv_slots, grid)  # (B, H_kv, S, D|D_v)
        b, num_q = grid.batch_size, grid.max_queries
        if grid.query_rows is None:
            queries = q.reshape(b, num_q, *q.shape[1:])
        else:
            queries = q.new_zeros(b * num_q, *q.shape[1:])
            queries[grid.query_rows] = q
            queries = queries.view(b, num_q, *q.shape[1:])
        queries = queries.transpose(1, 2)  # (B, H, Q, D)
        if layer.logit_softcap is None:
            out = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=grid.mask(q.dtype), scale=layer.scaling,
                enable_gqa=layer.num_heads != layer.num_kv_heads)  # (B, H, Q, D_v)
        else:
            out = _softcapped(queries, keys, values, grid.mask(torch.float32), layer)
        out = out.transpose(1, 2).reshape(b * num_q, q.shape[1], values.shape[-1])
        return out if grid.query_rows is None else out[grid.query_rows]

    def _grid_kv(self, k, v, layer, kv_slots: torch.Tensor,
                 grid: WindowedGrid) -> tuple[torch.Tensor, torch.Tensor]:
        """The grid's keys (B, H_kv, S, D) and values (B, H_kv, S, D_v): the prefix's read
        from the layer's buffers at ``kv_slots``, the new tokens' as computed."""
        pool = self._fb.kv_pool
        k_buffer, v_buffer = pool.get_kv(layer.layer_id)
        slots = kv_slots.view(-1)
        shape = (*kv_slots.shape, *k_buffer.shape[1:])
        keys = k_buffer.index_select(0, slots).index_copy_(0, grid.new_rows, k).view(shape)
        if pool.values_view_keys:
            values = keys[..., : v_buffer.shape[-1]]
        else:
            values = v_buffer.index_select(0, slots).index_copy_(0, grid.new_rows, v)
            values = values.view(*kv_slots.shape, *v_buffer.shape[1:])
        return keys.transpose(1, 2), values.transpose(1, 2)


def _softcapped(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                mask: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
    """softmax(c * tanh(q k^T * scaling / c) + mask) v in float32 (float64 for float64) for
    queries (B, H, Q, D) over keys (B, H_kv, S, D) and values (B, H_kv, S, D_v) under mask
    (B, 1, Q, S): (B, H, Q, D_v) in the queries' dtype. A KV head's G query heads are scored as one
    matrix, so grouped-query attention needs no repeated K/V."""
    b, num_heads, num_q, head_dim = queries.shape
    kv_heads, group, cap = keys.shape[1], num_heads // keys.shape[1], layer.logit_softcap
    compute = torch.promote_types(queries.dtype, torch.float32)
    keys_t = keys.to(compute).transpose(-1, -2)  # (B, H_kv, D, S)
    values32 = values.to(compute)
    out = queries.new_empty(b, num_heads, num_q, values.shape[-1])
    for r0 in range(0, num_q, QUERY_CHUNK):
        rows = slice(r0, min(r0 + QUERY_CHUNK, num_q))
        n = rows.stop - r0
        grouped = queries[:, :, rows].to(compute).reshape(b, kv_heads, group * n, head_dim)
        scores = torch.matmul(grouped, keys_t) * layer.scaling  # (B, H_kv, G * n, S)
        scores = torch.tanh(scores / cap) * cap
        scores = scores.view(b, kv_heads, group, n, -1) + mask[:, :, None, rows]
        probs = torch.softmax(scores, dim=-1).view(b, kv_heads, group * n, -1)
        chunk = torch.matmul(probs, values32)  # (B, H_kv, G * n, D_v)
        out[:, :, rows] = chunk.view(b, num_heads, n, -1).to(out.dtype)
    return out
