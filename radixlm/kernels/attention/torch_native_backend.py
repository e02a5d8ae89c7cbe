"""Attention in plain PyTorch: the CPU backend and the reference the kernels are tested against.

Each batch is turned once into a padded layout shared by all layers: a (B, S) table of KV
slots (S = the longest sequence), where each request's queries sit in a (B, Q) grid, and a
boolean mask that lets query i of request b see keys 0 .. prefix_b + i. Each layer then
gathers its K and V through the table and runs one ``scaled_dot_product_attention`` for
the whole batch, prefill and decode alike. A single sequence with no cached prefix (a
fresh prompt's prefill) attends over its new K/V as computed, without reading them back.
An extend batch whose padded grid would cost more than its sequences' own attention
(``_split_pays``: ragged lengths, long prompts) attends sequence by sequence instead.

Masks are additive (0 or -inf, in the pool's dtype), built once a batch: SDPA converts a
boolean mask into that form on every call. A long sequence after a short cached prefix
(``_pads_causally``) takes no mask at all: its queries are placed after as many zero rows
as the prefix has keys, and one causal call skips the blocks above the diagonal, which a
mask over the same keys cannot (the more so the longer the sequence). The zero rows'
outputs are dropped. Figures in benchmarks/RESULTS.md.

Where the fused kernels' causal prefill attention serves (``fused_ops.causal_prefill_attention``:
bfloat16 on AVX-512 BF16 without AMX, float32 on AVX2 or AVX-512), none of that is built:
every extend batch, its sequences fresh or after prefixes of any length, goes to that
kernel in one call a layer, which reads each sequence's keys where they lie in the pool and
computes only the blocks its causal mask keeps: no padded call, gather or mask (figures in
benchmarks/RESULTS.md).

Values may have a head dim D_v other than the keys' D (multi-head latent attention: keys
are latent + RoPE rows, values the latent alone, read as a view of the gathered keys);
the output then has D_v per head.

A decode batch whose requests share prefixes of slots (``ForwardBatch.shared_prefixes``, a
beam search's beams) reads each shared prefix once for its run of requests. Other decode
batches on a CPU with the fused kernels on (``radixlm.kernels.cpu_ops.fused_ops``) attend
over the keys where they lie in the pool, without the gather.

Layers with a sliding window, a logit softcap or a slot map of the pool's own take none of
these paths (``needs_windowed_path``): ``windowed_attention.py`` serves them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixlm.kernels.attention.attention_backend import AttentionBackend, LayerDecodeTables
from radixlm.kernels.attention.shared_prefix_decode import (
    SharedPrefixRun,
    attend_shared_prefix,
    plan_runs,
)
from radixlm.kernels.attention.windowed_attention import WindowedAttention, needs_windowed_path
from radixlm.kernels.cpu_ops import fused_ops
from radixlm.kernels.cpu_ops.execution_plan import TORCH_CHOICES, CpuExecutionPlan
from radixlm.kernels.forward_batch import ForwardBatch, ForwardMode


@dataclass
class _Sequence:
    """One sequence of an extend batch, attended on its own."""

    start: int  # its first new token in the batch
    length: int  # its new tokens
    slots: torch.Tensor | None  # (S,) the KV slots of all its keys; None: fresh (no prefix)
    mask: torch.Tensor | None  # (length, S) additive; None: causal (fresh or padded)


@dataclass
class _PaddedLayout:
    kv_slots: torch.Tensor  # (B, S) slot of key j of request b (padding: any valid slot)
    query_rows: torch.Tensor | None  # (T,) row of each new token in the flattened (B * Q) grid
    mask: torch.Tensor | None  # (B, 1, Q, S) additive (0: visible, -inf); None: all visible
    is_causal: bool  # a single sequence, fresh, after a short prefix or for the kernel: no mask
    fresh_keys: bool  # its keys are the new K/V as computed (nothing to read back)
    batch_size: int
    max_queries: int
    sequences: list[_Sequence] | None = None
    """Extend only, where attending sequence by sequence costs less than the padded grid
    (``_split_pays``): the batch's sequences; the padded fields are then unused."""
    shared: list[SharedPrefixRun] | None = None
    """Decode only: runs of requests sharing a prefix (``shared_prefix_decode.py``); the
    other requests are ``plain_rows``."""
    plain_rows: torch.Tensor | None = None


@dataclass(frozen=True)
class _InPoolExtend:
    """An extend batch that the fused causal prefill attention (where it serves the pool's
    dtype and head dims) attends whole, each sequence over its keys where they lie in the
    pool: no gather, padding or mask."""

    kv_slots: torch.Tensor  # (B, S) slot of key j of request b (past its keys: unread)
    kernel: Callable  # fused_ops.causal_prefill_attention's paged_prefill_attention


CALL_COST_PAIRS = 4096
"""What one attention call costs beyond its work, in query-key pairs: a call's fixed cost over
the padded call's pairs a microsecond, with margin toward one call (benchmarks/RESULTS.md)."""


CAUSAL_PAD_MIN_KEYS = 384
"""The fewest keys at which a sequence after a short prefix attends causally over padded
queries rather than under a mask (below it the causal kernel skips too little)."""
CAUSAL_PAD_MAX_PREFIX = 1 / 8
"""The largest share of a sequence's new tokens its cached prefix may have for the padded
causal call: the zero rows cost the prefix's own pairs again (benchmarks/RESULTS.md)."""


def _pads_causally(new: int, total: int) -> bool:
    """Whether a sequence of ``total`` keys, the last ``new`` of them new, attends causally
    after ``total - new`` zero queries instead of under a mask."""
    prefix = total - new
    return 0 < prefix <= new * CAUSAL_PAD_MAX_PREFIX and total >= CAUSAL_PAD_MIN_KEYS


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as SDPA's additive one: 0 where visible, -inf elsewhere."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
        ~visible, float("-inf"))


def _split_pays(extend_lens: list[int], seq_lens: list[int]) -> bool:
    """Whether an extend batch attends for less sequence by sequence than in the padded
    (B, Q, S) grid: a fresh sequence's causal call skips half its pairs, one after a prefix
    gets a mask over its own keys (all pairs), and each call adds ``CALL_COST_PAIRS``."""
    if len(seq_lens) < 2 or max(extend_lens) < 2:
        return False
    padded = len(seq_lens) * max(extend_lens) * max(seq_lens)
    split = sum(n * s // (2 if n == s else 1) + CALL_COST_PAIRS
                for n, s in zip(extend_lens, seq_lens))
    return split < padded


class TorchNativeAttentionBackend(AttentionBackend):
    supports_cuda_graph = False  # its layout and mask are built per batch, sized by the host
    uses_custom_kernels = False

    def __init__(self, cpu_plan: CpuExecutionPlan = TORCH_CHOICES) -> None:
        """``cpu_plan``: the model's, which says where the fused kernels attend bfloat16
        prompts (``CpuExecutionPlan.pair_kernels``)."""
        self.cpu_plan = cpu_plan
        self._layout: _PaddedLayout | _InPoolExtend | None = None
        self._windowed: WindowedAttention | None = None  # the batch's windowed layers'

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        self._windowed = WindowedAttention(fb)
        extend_lens = fb.extend_seq_lens_list
        seq_lens = fb.seq_lens_list
        batch_size, max_q, max_kv = len(seq_lens), max(extend_lens), max(seq_lens)
        device = fb.input_ids.device
        kv_slots = fb.req_to_token[fb.req_pool_indices, :max_kv].contiguous()
        kernel = fused_ops.causal_prefill_attention(
            *fb.kv_pool.get_kv(0), self.cpu_plan.pair_kernels
        ) if fb.mode is ForwardMode.EXTEND else None
        if kernel is not None:
            self._layout = _InPoolExtend(kv_slots, kernel)
            return
        single_fresh = batch_size == 1 and extend_lens[0] == seq_lens[0]
        single_causal = single_fresh or (
            batch_size == 1 and _pads_causally(extend_lens[0], seq_lens[0]))
        uniform_decode = max_q == 1 and min(seq_lens) == max_kv
        query_rows = mask = None
        if _split_pays(extend_lens, seq_lens):
            self._layout = _PaddedLayout(
                kv_slots, None, None, False, False, batch_size, max_q,
                sequences=self._sequences(kv_slots, fb))
            return
        if max_q > 1 and batch_size > 1:
            starts = torch.tensor(extend_lens, device=device).cumsum(0) - fb.extend_seq_lens
            req_of_token = torch.repeat_interleave(
                torch.arange(batch_size, device=device), fb.extend_seq_lens
            )
            offset_in_req = torch.arange(len(fb.input_ids), device=device) - starts[req_of_token]
            query_rows = req_of_token * max_q + offset_in_req
        if not (single_causal or uniform_decode):
            i = torch.arange(max_q, device=device)
            j = torch.arange(max_kv, device=device)
            # Padded query rows repeat the request's last query, so no row is fully masked.
            last_visible = fb.prefix_lens[:, None] + torch.minimum(
                i[None, :], (fb.extend_seq_lens - 1)[:, None]
            )  # (B, Q)
            visible = j[None, None, :] <= last_visible[:, :, None]  # (B, Q, S)
            mask = _additive(visible, fb.kv_pool.dtype).unsqueeze(1)  # (B, 1, Q, S)
        self._layout = _PaddedLayout(
            kv_slots, query_rows, mask, single_causal, single_fresh, batch_size, max_q)
        if max_q == 1 and fb.shared_prefixes:
            self._plan_shared(fb)

    @staticmethod
    def _sequences(kv_slots: torch.Tensor, fb: ForwardBatch) -> list[_Sequence]:
        """The batch's sequences, each with its slots if it has a prefix, and its mask if it
        has one and is not padded."""
        sequences = []
        starts = itertools.accumulate(fb.extend_seq_lens_list[:-1], initial=0)
        for row, (start, new, total) in enumerate(
                zip(starts, fb.extend_seq_lens_list, fb.seq_lens_list)):
            if new == total:
                sequences.append(_Sequence(start, new, None, None))
                continue
            mask = None
            if not _pads_causally(new, total):
                i = torch.arange(new, device=kv_slots.device)[:, None]
                j = torch.arange(total, device=kv_slots.device)[None, :]
                mask = _additive(j <= total - new + i, fb.kv_pool.dtype)  # (new, total)
            sequences.append(_Sequence(start, new, kv_slots[row, :total], mask))
        return sequences

    def _plan_shared(self, fb: ForwardBatch) -> None:
        layout = self._layout
        runs = plan_runs(layout.kv_slots, fb.seq_lens_list, fb.shared_prefixes)
        if not runs:
            return
        in_runs = {row for run in runs for row in range(run.start, run.start + run.count)}
        plain = [row for row in range(layout.batch_size) if row not in in_runs]
        layout.shared = runs
        layout.plain_rows = torch.tensor(plain, dtype=torch.int64,
                                         device=layout.kv_slots.device)

    def forward_extend(self, q, k, v, layer, forward_batch):
        if needs_windowed_path(layer, forward_batch):
            return self._windowed.forward(q, k, v, layer)
        return self._attend(q, k, v, layer, forward_batch)

    def forward_decode(self, q, k, v, layer, forward_batch):
        """One query per request (see ``_decode``)."""
        if needs_windowed_path(layer, forward_batch):
            return self._windowed.forward(q, k, v, layer)
        layout = self._layout
        kernels = fused_ops.for_tensor(q)
        if layout.shared is None and kernels is not None:
            return self._decode_in_pool(kernels, q, k, v, layer, forward_batch)
        if layout.shared is None:
            keys, values = self._gather_kv(k, v, layer, forward_batch)  # (B, H_kv, S, D|D_v)
            return self._decode(q, keys, values, layer, layout.mask)
        pool = forward_batch.kv_pool
        pool.set_kv(layer.layer_id, forward_batch.out_cache_loc, k, v)
        k_buffer, v_buffer = pool.get_kv(layer.layer_id)
        out = q.new_empty(q.shape[0], layer.num_heads, v_buffer.shape[-1])
        plain = layout.plain_rows
        if plain.numel():
            keys, values = self._read_kv(pool, layer, layout.kv_slots.index_select(0, plain))
            mask = None if layout.mask is None else layout.mask.index_select(0, plain)
            out[plain] = self._decode(q.index_select(0, plain), keys, values, layer, mask)
        for run in layout.shared:
            rows = slice(run.start, run.start + run.count)
            out[rows] = attend_shared_prefix(q[rows], run, k_buffer, v_buffer,
                                             pool.values_view_keys, layer.num_kv_heads,
                                             layer.scaling)
        return out

    def pool_decode_tables(self, forward_batch):
        """None too where the pool maps slots; windowed layers never ask (cpu_decode_runner)."""
        layout = self._layout
        if (forward_batch.mode is not ForwardMode.DECODE or layout.shared is not None
                or fused_ops.for_tensor(layout.kv_slots) is None
                or self._windowed.pool_maps_slots()):
            return None
        return layout.kv_slots, forward_batch.seq_lens

    def layer_decode_tables(self, forward_batch, layer):
        """What the layer's ``forward_decode`` stores and attends with on the fused kernels:
        the windowed path's tables where it goes there, else the batch's own."""
        layout = self._layout
        if (forward_batch.mode is not ForwardMode.DECODE or layout.shared is not None
                or fused_ops.for_tensor(layout.kv_slots) is None):
            return None
        if needs_windowed_path(layer, forward_batch):
            return self._windowed.decode_tables(layer)
        return LayerDecodeTables(forward_batch.out_cache_loc, layout.kv_slots,
                                 forward_batch.seq_lens, 0.0)

    def _decode_in_pool(self, kernels, q, k, v, layer, fb: ForwardBatch) -> torch.Tensor:
        """Stores the new K/V, then attends over each request's keys where they lie in the
        pool (the fused CPU kernel: no gather, no padding)."""
        pool = fb.kv_pool
        pool.set_kv(layer.layer_id, fb.out_cache_loc, k, v)
        k_buffer, v_buffer = pool.get_kv(layer.layer_id)  # (a latent pool's v: a view of k)
        return kernels.paged_decode_attention(q, k_buffer, v_buffer, self._layout.kv_slots,
                                              fb.seq_lens, layer.scaling)

    @staticmethod
    def _decode(q, keys, values, layer, mask) -> torch.Tensor:
        """q (B, H, D) over keys (B, H_kv, S, D) and values (B, H_kv, S, D_v); ``mask``
        (B, 1, 1, S) or None: (B, H, D_v). A KV head's G query heads stand where SDPA
        expects query positions (every one sees the same keys), so grouped-query
        attention needs no repeated K/V."""
        b, group = q.shape[0], layer.num_heads // layer.num_kv_heads
        queries = q.view(b, layer.num_kv_heads, group, layer.head_dim)  # (B, H_kv, G, D)
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, scale=layer.scaling)  # (B, H_kv, G, D_v)
        return out.reshape(b, layer.num_heads, values.shape[-1])

    def _gather_kv(self, k, v, layer, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores the new K/V, then reads every request's K/V (``_read_kv``)."""
        pool = fb.kv_pool
        pool.set_kv(layer.layer_id, fb.out_cache_loc, k, v)
        return self._read_kv(pool, layer, self._layout.kv_slots)

    @staticmethod
    def _store_fresh_kv(k, v, layer, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores the new K/V and returns them as (1, H_kv, T, D) and (1, H_kv, T, D_v):
        a fresh sequence's keys are all new, so nothing is read back."""
        pool = fb.kv_pool
        pool.set_kv(layer.layer_id, fb.out_cache_loc, k, v)
        if pool.values_view_keys:
            v = k[..., : pool.get_kv(layer.layer_id)[1].shape[-1]]
        return k.unsqueeze(0).transpose(1, 2), v.unsqueeze(0).transpose(1, 2)

    @staticmethod
    def _read_kv(pool, layer, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V at ``slots`` (B, S) as (B, H_kv, S, D) and (B, H_kv, S, D_v). A latent
        (MLA) pool's values are a slice of its keys: one gather."""
        k_buffer, v_buffer = pool.get_kv(layer.layer_id)
        # index_select on flat indices: far cheaper on CPUs than advanced indexing.
        keys = k_buffer.index_select(0, slots.view(-1)).view(*slots.shape, *k_buffer.shape[1:])
        if pool.values_view_keys:
            values = keys[..., : v_buffer.shape[-1]]  # (B, S, H_kv, D_v), a view
        else:
            values = v_buffer.index_select(0, slots.view(-1))
            values = values.view(*slots.shape, *v_buffer.shape[1:])
        return keys.transpose(1, 2), values.transpose(1, 2)

    @staticmethod
    def _attend_in_pool(layout: _InPoolExtend, q, k, v, layer,
                        fb: ForwardBatch) -> torch.Tensor:
        """Stores the new K/V, then the prefill kernel attends every sequence's queries
        over its keys where they lie in the pool: (T, H, D_v)."""
        pool = fb.kv_pool
        pool.set_kv(layer.layer_id, fb.out_cache_loc, k, v)
        k_buffer, v_buffer = pool.get_kv(layer.layer_id)
        return layout.kernel(q, k_buffer, v_buffer, layout.kv_slots, fb.seq_lens,
                             fb.extend_seq_lens, layer.scaling)

    def _attend_each(self, q, k, v, layer, fb: ForwardBatch) -> torch.Tensor:
        """Sequence by sequence, unpadded: a fresh one causal over its own new K/V (as
        computed: nothing read back), one after a prefix over its own keys, gathered, with
        its mask or causally after zero queries (``_pads_causally``)."""
        pool = fb.kv_pool
        new_keys, new_values = self._store_fresh_kv(k, v, layer, fb)  # (1, H_kv, T, D|D_v)
        outs = []
        for seq in self._layout.sequences:
            new = slice(seq.start, seq.start + seq.length)
            if seq.slots is None:
                keys, values = new_keys[:, :, new], new_values[:, :, new]
            else:
                keys, values = self._read_kv(pool, layer, seq.slots[None])  # (1, H_kv, S, .)
            if seq.mask is None:
                outs.append(self._causal(q[new], keys, values, layer))
            else:
                outs.append(F.scaled_dot_product_attention(
                    q[new].unsqueeze(0).transpose(1, 2), keys, values, attn_mask=seq.mask,
                    scale=layer.scaling, enable_gqa=layer.num_heads != layer.num_kv_heads,
                )[0].transpose(0, 1))  # (n, H, D_v)
        return torch.cat(outs)  # (T, H, D_v)

    def _causal(self, q, keys, values, layer) -> torch.Tensor:
        """q (n, H, D), the last n of the S positions of keys (1, H_kv, S, D) and values
        (1, H_kv, S, D_v) -> (n, H, D_v), each query over the keys up to its own position:
        one SDPA causal call (``_attend_causally``)."""
        out = _attend_causally(q.unsqueeze(0).transpose(1, 2), keys, values, layer)
        return out[0].transpose(0, 1)

    def _attend(self, q, k, v, layer, fb: ForwardBatch) -> torch.Tensor:
        layout = self._layout
        if isinstance(layout, _InPoolExtend):
            return self._attend_in_pool(layout, q, k, v, layer, fb)
        if layout.sequences is not None:
            return self._attend_each(q, k, v, layer, fb)
        if layout.fresh_keys:  # a single fresh sequence: its K/V are the new ones
            keys, values = self._store_fresh_kv(k, v, layer, fb)  # (1, H_kv, T, D|D_v)
        else:
            keys, values = self._gather_kv(k, v, layer, fb)  # (B, H_kv, S, D|D_v)
        if layout.is_causal:  # one sequence: its queries are its last keys
            return self._causal(q, keys, values, layer)  # (T, H, D_v)
        b, num_q = layout.batch_size, layout.max_queries
        if layout.query_rows is None:
            queries = q.view(b, num_q, *q.shape[1:])  # (B, Q, H, D)
        else:
            queries = q.new_zeros(b * num_q, *q.shape[1:])
            queries[layout.query_rows] = q
            queries = queries.view(b, num_q, *q.shape[1:])
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2),  # (B, H, Q, D)
            keys,
            values,
            attn_mask=layout.mask,
            scale=layer.scaling,
            enable_gqa=layer.num_heads != layer.num_kv_heads,
        )  # (B, H, Q, D_v)
        out = out.transpose(1, 2).reshape(b * num_q, q.shape[1], values.shape[-1])
        if layout.query_rows is not None:
            out = out[layout.query_rows]
        return out


def _attend_causally(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     layer) -> torch.Tensor:
    """queries (1, H, n, D), the last n of the S positions of keys (1, H_kv, S, D) and
    values (1, H_kv, S, D_v) -> (1, H, n, D_v): each query sees the keys up to its own
    position. SDPA's causal call aligns queries with the first keys, so the S - n positions
    before them get zero queries, whose outputs are dropped."""
    pad = keys.shape[2] - queries.shape[2]
    if pad:
        queries = F.pad(queries, (0, 0, pad, 0))  # (1, H, S, D)
    out = F.scaled_dot_product_attention(
        queries, keys, values, is_causal=queries.shape[2] > 1, scale=layer.scaling,
        enable_gqa=layer.num_heads != layer.num_kv_heads,
    )  # (1, H, S, D_v)
    return out[:, :, pad:]
