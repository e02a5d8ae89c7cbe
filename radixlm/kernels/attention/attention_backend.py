"""The attention backend interface: attention over the paged KV pool.

A backend is told the batch once (``init_forward_metadata``) and then called per layer.
It writes the new tokens' K and V into the pool at ``forward_batch.out_cache_loc`` and
attends each new query token to its request's cached prefix and to the new tokens up to
and including itself (causal). It reads a request's keys only through the index table
``req_to_token``, so a request's KV may be scattered anywhere in the pool.

Capabilities are declared on the backend, so callers ask it instead of testing its class
or name: ``supports_cuda_graph`` (with the two graph hooks) and ``uses_custom_kernels``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from radixlm.kernels.attention.attention_layer import AttentionLayer
from radixlm.kernels.forward_batch import ForwardBatch, ForwardMode


class LayerDecodeTables(NamedTuple):
    """Where one layer's decode step of a batch stores its new K/V and reads its keys when
    the fused CPU kernels' ``paged_decode_attention`` attends over the pool: the layer's
    slot map, window and softcap applied (``AttentionBackend.layer_decode_tables``)."""

    write_slots: torch.Tensor  # (B,) the layer-buffer row of each new token's K/V
    kv_slots: torch.Tensor  # (B, S) the layer-buffer rows of each request's visible keys
    key_lens: torch.Tensor  # (B,) how many of a row's kv_slots hold its keys
    softcap: float  # the scores' soft cap, 0.0 for none


@dataclass(frozen=True)
class DecodeGraphSpec:
    """What a backend is told once before decode steps are captured as CUDA graphs over it.

    ``batch_sizes``: every batch size that will be captured, ascending (a batch of B
    requests is padded to the smallest one >= B); ``max_context_len``: the most tokens a
    request may hold; ``layer``: the head layout all layers share; ``kv_pool``: the pool
    the graphs attend over; ``device``: the CUDA device they run on.
    """

    batch_sizes: tuple[int, ...]
    max_context_len: int
    layer: AttentionLayer
    kv_pool: Any
    device: torch.device

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]


class AttentionBackend(ABC):
    """Contract:

    - ``init_forward_metadata`` is called once per batch, before any layer runs; whatever
      it precomputes (index tables, masks, plans) is shared by all layers.
    - ``forward_extend`` / ``forward_decode`` receive q: (T, H, D), k: (T, H_kv, D) and
      v: (T, H_kv, D_v) for the batch's new tokens, store k and v into layer
      ``layer.layer_id`` of the pool, and return the attention output (T, H, D_v) in q's
      dtype. D_v is ``layer.v_head_dim``; it equals D except for multi-head latent
      attention.
    - MLA (``kv_pool.values_view_keys``): H_kv = 1, k is the latent + RoPE row
      (D = kv_lora_rank + qk_rope_head_dim), v is the view k[..., :kv_lora_rank]; the pool
      stores only k and serves the values as a view of it (``MLATokenToKVPool``). Queries
      arrive already absorbed into the latent space, so MLA is plain multi-query attention
      with D_v < D.
    - Neither call changes the index tables or any other layer's KV.

    CUDA graphs (only where ``supports_cuda_graph``): the caller calls
    ``prepare_decode_graphs`` once, then captures the model's decode step once per batch
    size and replays it; before each capture and each replay it calls
    ``init_decode_graph_metadata`` (outside the graph) instead of ``init_forward_metadata``,
    with a DECODE batch whose tensors are views of the same static buffers every time.
    """

    supports_cuda_graph: bool = False
    """True when decode steps over this backend may be captured as CUDA graphs and replayed:
    its decode kernels launch without host syncs or host-dependent shapes once the two graph
    hooks below have run, and it implements them."""

    uses_custom_kernels: bool = False
    """True when the backend runs hand-written GPU kernels (Triton, FlashInfer) rather than
    torch ops; the model runner then also runs the model's layers that have a Triton kernel
    (fused MoE experts) on it, where Triton can run."""

    def check_latent_heads(self, latent_dim: int, rope_dim: int, dtype: torch.dtype,
                           device: torch.device) -> None:
        """Raises ValueError, naming what to use instead, where this backend cannot attend
        over MLA's latent KV (``latent_dim`` + ``rope_dim`` wide) in ``dtype`` on ``device``:
        called once when the model runner starts, so that a start fails rather than the
        first step. Every backend here that attends over latent KV can, but Triton's."""
        return None

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None: ...

    @abstractmethod
    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        layer: AttentionLayer, forward_batch: ForwardBatch,
    ) -> torch.Tensor: ...

    @abstractmethod
    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        layer: AttentionLayer, forward_batch: ForwardBatch,
    ) -> torch.Tensor: ...

    def pool_decode_tables(
        self, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where this batch's decode attention is the fused CPU kernels'
        ``paged_decode_attention`` over the pool, the (kv_slots (B, S), seq_lens (B,)) it
        reads them with, so that a layer may run its whole decode step in one kernel call
        (``models/layers/cpu_decode_layer.py``); else None (the default)."""
        return None

    def layer_decode_tables(
        self, forward_batch: ForwardBatch, layer: AttentionLayer
    ) -> LayerDecodeTables | None:
        """Where this batch's decode attention for ``layer`` is the fused CPU kernels'
        ``paged_decode_attention`` over the pool, whatever the layer's window, softcap or
        slot map, the tables its step stores and reads with, so that its whole step may run
        in one kernel call (``models/layers/cpu_sandwich_decode.py``); else None (the
        default). Layers alike in window, softcap and slot map get equal tables (the caller
        asks once per kind in a batch)."""
        return None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        layer: AttentionLayer, forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        if forward_batch.mode is ForwardMode.DECODE:
            return self.forward_decode(q, k, v, layer, forward_batch)
        return self.forward_extend(q, k, v, layer, forward_batch)

    # CUDA graphs ----------------------------------------------------------------------------

    def prepare_decode_graphs(self, spec: DecodeGraphSpec) -> None:
        """Allocates, once and before any capture, whatever the captured decode kernels must
        find at a fixed address for each size in ``spec.batch_sizes`` (index buffers of a
        plan, split-KV scratch), sized so no later replay reallocates it.

        Only called on backends with ``supports_cuda_graph``; the others raise.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_decode_graph_metadata(self, forward_batch: ForwardBatch) -> None:
        """``init_forward_metadata`` for a captured decode step: called outside the graph,
        before capturing and before every replay, with the static DECODE batch of one size
        in ``batch_sizes`` (padding rows included; ``seq_lens_list`` is the host copy of
        this step's lengths). It may rewrite the contents of what the graph reads but never
        reallocates it, so the replayed kernels read this step's metadata.

        Only called after ``prepare_decode_graphs``; backends without graphs raise.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")
