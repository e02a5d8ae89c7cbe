"""What an attention backend reads from the layer it attends for: its identity and head layout.

Backends take any object with these attributes, so the kernels do not depend on the model
code that defines its attention layers (``radixlm.models.layers.attention.PagedAttention``
is one); imports point one way, models -> kernels.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class AttentionLayer(Protocol):
    """One attention layer, as a backend sees it. Read-only for backends.

    - ``layer_id``: the pool layer its K/V live in (``kv_pool.get_kv(layer_id)``);
    - ``num_heads`` (H) query heads and ``num_kv_heads`` (H_kv) key/value heads, with
      H a multiple of H_kv (grouped-query attention);
    - ``head_dim`` (D) of queries and keys, ``v_head_dim`` (D_v) of values and of the
      output; equal except for multi-head latent attention;
    - ``scaling``: the softmax scale applied to q k^T;
    - ``sliding_window``: None (the query sees every earlier key) or W, the number of most
      recent keys a query sees, its own included: query at position i sees keys j with
      i - W < j <= i (Hugging Face's convention, Mistral's and Gemma's local layers);
    - ``logit_softcap``: None or c: scores become c * tanh(scores / c) after scaling and
      before the mask and softmax (Gemma 2).
    """

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    scaling: float
    sliding_window: int | None
    logit_softcap: float | None
