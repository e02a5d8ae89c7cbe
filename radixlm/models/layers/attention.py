"""The attention layer a model calls: it holds the layer's identity, the backend does the work
(under torch.compile, through the opaque operator ``compiled_ops.paged_attention``)."""

from __future__ import annotations

import torch
from torch import nn

from radixlm.kernels.forward_batch import ForwardBatch
from radixlm.models.layers.compiled_ops import paged_attention


class PagedAttention(nn.Module):
    """softmax(q k^T * scaling) v over the request's cached and new tokens, read from the pool.

    Has no weights: it names the layer (``layer_id``, the pool layer its KV lives in) and
    the head layout, and delegates to ``forward_batch.attn_backend``. It is the
    ``AttentionLayer`` (kernels/attention/attention_layer.py) the backend reads.
    """

    def __init__(
        self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float,
        v_head_dim: int | None = None, sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ):
        """``v_head_dim``: the values' head dim when it differs from the keys' (MLA);
        ``sliding_window``, ``logit_softcap``: see ``AttentionLayer``."""
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.scaling = scaling
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """q: (T, H, D), k: (T, H_kv, D), v: (T, H_kv, D_v) -> (T, H, D_v)."""
        if torch.compiler.is_compiling():
            return paged_attention(q, k, v, self.layer_id, self.v_head_dim)
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch)
