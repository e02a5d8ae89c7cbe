"""The Triton attention backend: paged extend and split-KV decode kernels over the KV pool.

Per batch (``init_forward_metadata``): the first query row of each request and the longest
extend; per layer: store the new K/V with ``store_kv``, then run ``extend_attention`` or
``decode_attention``. Keys are always read through ``req_to_token``, so the backend works
for any page size (a page is a run of consecutive slots; the kernels read slot by slot).

On GPUs the kernels compile for the device. On CPUs they run only under Triton's
interpreter (``TRITON_INTERPRET=1`` set before radixlm imports them), which is how CI
checks them; ``require_triton_runnable`` says why they cannot run otherwise.

Latent (MLA) pools (``kv_pool.values_view_keys``): only the key rows are stored, the
values are their first D_v dims (a view); extend runs the same kernel with D_v < D_k, and
decode runs the MLA variant, which loads each latent row once for keys and values.

Layers with a sliding window or a logit softcap pass them to both kernels; a layer whose
pool holds its K/V under a slot map (``kv_pool.slot_map_for``) passes the map, which the
kernels apply to every slot they read from the pool (the new K/V are stored through the
pool's own ``set_kv``, which maps them). The latent (MLA) decode kernel has neither.

Decode scratch (per-split partial outputs) is allocated once per batch and shared by all
layers; ``reserve_decode_scratch`` pins a buffer for the largest batch, so that CUDA graphs
captured over it replay on the same memory (``prepare_decode_graphs`` does so). Decode
needs no other per-batch metadata, so a graph replay only resets the per-batch scratch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.kernels.attention.attention_backend import AttentionBackend, DecodeGraphSpec
from radixlm.kernels.forward_batch import ForwardBatch, ForwardMode
from radixlm.kernels.triton_ops import tile_plan
from radixlm.kernels.triton_ops.decode_attention import decode_attention, decode_scratch
from radixlm.kernels.triton_ops.extend_attention import extend_attention
from radixlm.kernels.triton_ops.kv_store import store_kv
from radixlm.kernels.triton_ops.mla_decode import mla_decode_attention


@dataclass
class TritonBackendConfig:
    """Tuning knobs of the Triton kernels.

    ``num_kv_splits``: key ranges per request in decode (more splits: more parallelism on
    long contexts, more merging work). Block sizes: queries / keys per program tile.
    """

    num_kv_splits: int = 8
    extend_block_m: int = 64
    extend_block_n: int = 64
    decode_block_n: int = 64

    def __post_init__(self) -> None:
        for name in ("num_kv_splits", "extend_block_m", "extend_block_n", "decode_block_n"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("extend_block_m", "extend_block_n", "decode_block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")

    @classmethod
    def for_device(cls, device: torch.device) -> TritonBackendConfig:
        """Large tiles on GPUs; small ones under the interpreter, where each tile is numpy."""
        if device.type == "cuda":
            return cls()
        return cls(num_kv_splits=4, extend_block_m=16, extend_block_n=16, decode_block_n=16)


class TritonAttentionBackend(AttentionBackend):
    supports_cuda_graph = True
    uses_custom_kernels = True

    def __init__(self, config: TritonBackendConfig | None = None, device: str = "cpu"):
        self.config = config or TritonBackendConfig.for_device(torch.device(device))
        self._extend_starts: torch.Tensor | None = None
        self._max_extend = 0
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        self._reserved_scratch: tuple[torch.Tensor, torch.Tensor] | None = None

    def check_latent_heads(self, latent_dim: int, rope_dim: int, dtype: torch.dtype,
                           device: torch.device) -> None:
        """The tiles MLA prefill and decode will take on ``device`` (``tile_plan``), planned
        now: where none fits its shared memory (float32 prefill on a 99 KiB GPU) the
        ValueError comes at start-up."""
        limit = tile_plan.shared_memory_per_block(device)
        tile_plan.extend_tiles(latent_dim + rope_dim, latent_dim, dtype, limit,
                               self.config.extend_block_m, self.config.extend_block_n)
        tile_plan.mla_decode_tiles(latent_dim, rope_dim, dtype, limit,
                                   block_n=self.config.decode_block_n)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        self._scratch = None
        if fb.mode is ForwardMode.DECODE:
            return
        self._extend_starts = torch.cumsum(fb.extend_seq_lens, 0) - fb.extend_seq_lens
        self._max_extend = max(fb.extend_seq_lens_list, default=0)

    def reserve_decode_scratch(
        self, max_batch_size: int, num_heads: int, head_dim_v: int, device: torch.device
    ) -> None:
        """Pins decode scratch for batches up to ``max_batch_size`` (CUDA-graph capture)."""
        self._reserved_scratch = decode_scratch(
            max_batch_size, num_heads, head_dim_v, self.config.num_kv_splits, device
        )

    def prepare_decode_graphs(self, spec: DecodeGraphSpec) -> None:
        """Pins decode scratch for the largest captured batch, in the pool's value width."""
        _, v_buffer = spec.kv_pool.get_kv(0)
        self.reserve_decode_scratch(
            spec.max_batch_size, spec.layer.num_heads, v_buffer.shape[-1], spec.device
        )

    def init_decode_graph_metadata(self, forward_batch: ForwardBatch) -> None:
        """Decode kernels read only the batch's tensors and the pinned scratch."""
        self.init_forward_metadata(forward_batch)

    def forward_extend(self, q, k, v, layer, forward_batch):
        fb = forward_batch
        k_buffer, v_buffer = self._store(k, v, layer, fb)
        out = q.new_empty(q.shape[0], layer.num_heads, v_buffer.shape[-1])
        extend_attention(
            q, k, v, out, k_buffer, v_buffer, fb.req_to_token, fb.req_pool_indices,
            fb.prefix_lens, fb.extend_seq_lens, self._extend_starts, self._max_extend,
            layer.scaling, block_m=self.config.extend_block_m,
            block_n=self.config.extend_block_n, sliding_window=layer.sliding_window,
            logit_softcap=layer.logit_softcap, slot_map=fb.kv_pool.slot_map_for(layer.layer_id),
        )
        return out

    def forward_decode(self, q, k, v, layer, forward_batch):
        fb = forward_batch
        k_buffer, v_buffer = self._store(k, v, layer, fb)
        batch_size, head_dim_v = q.shape[0], v_buffer.shape[-1]
        out = q.new_empty(batch_size, layer.num_heads, head_dim_v)
        scratch = self._decode_scratch(batch_size, layer.num_heads, head_dim_v, q.device)
        slot_map = fb.kv_pool.slot_map_for(layer.layer_id)
        if _is_latent_pool(fb.kv_pool):
            if not (layer.sliding_window is layer.logit_softcap is slot_map is None):
                raise NotImplementedError(
                    f"layer {layer.layer_id}: the Triton MLA decode has no sliding window, "
                    "logit softcap or slot map; use the torch-native backend")
            return mla_decode_attention(
                q, out, k_buffer, head_dim_v, fb.req_to_token, fb.req_pool_indices,
                fb.seq_lens, layer.scaling, self.config.num_kv_splits, scratch=scratch,
                block_n=self.config.decode_block_n,
            )
        decode_attention(
            q, out, k_buffer, v_buffer, fb.req_to_token, fb.req_pool_indices, fb.seq_lens,
            layer.scaling, self.config.num_kv_splits, scratch=scratch,
            block_n=self.config.decode_block_n, sliding_window=layer.sliding_window,
            logit_softcap=layer.logit_softcap, slot_map=slot_map,
        )
        return out

    def _store(self, k, v, layer, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        k_buffer, v_buffer = fb.kv_pool.get_kv(layer.layer_id)
        if fb.kv_pool.slot_map_for(layer.layer_id) is not None:  # the pool maps the slots
            fb.kv_pool.set_kv(layer.layer_id, fb.out_cache_loc, k, v)
        elif _is_latent_pool(fb.kv_pool):  # v is a view of k; the pool stores rows once
            store_kv(k, None, k_buffer, None, fb.out_cache_loc)
        else:
            store_kv(k, v, k_buffer, v_buffer, fb.out_cache_loc)
        return k_buffer, v_buffer

    def _decode_scratch(
        self, batch_size: int, num_heads: int, head_dim_v: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One buffer per batch for every layer; the pinned one when it fits."""
        for scratch in (self._reserved_scratch, self._scratch):
            if scratch is not None and scratch[0].shape[0] >= batch_size and scratch[0].shape[
                1:
            ] == (num_heads, self.config.num_kv_splits, head_dim_v):
                return scratch
        self._scratch = decode_scratch(
            batch_size, num_heads, head_dim_v, self.config.num_kv_splits, device
        )
        return self._scratch


def _is_latent_pool(pool) -> bool:
    """True for a pool whose values are a view of its keys (MLA's latent pool)."""
    return bool(getattr(pool, "values_view_keys", False))
