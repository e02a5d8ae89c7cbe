"""The attention backend interface: attention over the paged KV pool.

A backend is told the batch once (``init_forward_metadata``) and then called per layer.
It writes the new tokens' K and V into the pool at ``forward_batch.out_cache_loc`` and
attends each new query token to its request's cached prefix and to the new tokens up to
and including itself (causal). It reads a request's keys only through the index table
``req_to_token``, so a request's KV may be scattered anywhere in the pool.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from radixlm.kernels.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from radixlm.models.layers.attention import PagedAttention


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
    """

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None: ...

    @abstractmethod
    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        layer: PagedAttention, forward_batch: ForwardBatch,
    ) -> torch.Tensor: ...

    @abstractmethod
    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        layer: PagedAttention, forward_batch: ForwardBatch,
    ) -> torch.Tensor: ...

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        layer: PagedAttention, forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        if forward_batch.mode is ForwardMode.DECODE:
            return self.forward_decode(q, k, v, layer, forward_batch)
        return self.forward_extend(q, k, v, layer, forward_batch)
