"""What one forward pass over a batch of requests needs to know: the shared batch descriptor.

Models, attention backends and the model runner all read it; nothing in it is per layer.
Tokens of all requests are packed one after another (ragged, no padding): request ``b``
owns ``extend_seq_lens[b]`` consecutive rows of ``input_ids``.

The batch carries its attention backend typed as ``BatchAttention``, the one call a model
makes on it, so that this module does not import the backend contract (which imports it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any, Protocol

import torch

from radixlm.kernels.attention.attention_layer import AttentionLayer


class ForwardMode(Enum):
    EXTEND = auto()
    """New tokens of each request (a whole prompt, a chunk, or the part after a cache hit)."""
    DECODE = auto()
    """Exactly one new token per request."""


class BatchAttention(Protocol):
    """The attention a batch carries, as a model's attention layer calls it.

    Every ``AttentionBackend`` (kernels/attention/attention_backend.py) is one; its contract
    says what ``forward`` does: store ``k`` / ``v`` into layer ``layer.layer_id`` of
    ``forward_batch.kv_pool`` and return the attention output (T, H, D_v) for q (T, H, D).
    """

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        layer: AttentionLayer, forward_batch: ForwardBatch,
    ) -> torch.Tensor: ...


@dataclass
class ForwardBatch:
    """One step's batch.

    Shapes: B requests, T = sum(extend_seq_lens) new tokens.
    - ``input_ids``, ``positions``, ``out_cache_loc``: (T,)
    - ``req_pool_indices``, ``seq_lens``, ``prefix_lens``, ``extend_seq_lens``: (B,)

    Invariants: ``seq_lens == prefix_lens + extend_seq_lens``; the KV slots of request b's
    first ``seq_lens[b]`` tokens are ``req_to_token[req_pool_indices[b], :seq_lens[b]]``, and
    the last ``extend_seq_lens[b]`` of them equal its slice of ``out_cache_loc``.
    """

    mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    extend_seq_lens: torch.Tensor
    req_to_token: torch.Tensor
    kv_pool: Any
    attn_backend: BatchAttention
    # Host copies, so backends plan without device syncs.
    seq_lens_list: list[int] = field(default_factory=list)
    extend_seq_lens_list: list[int] = field(default_factory=list)
    lora: Any = None
    """The rows' LoRA adapters (``models/lora/lora_layers.LoraBatch``), None where no row
    uses one (typed loosely: kernels do not import the models)."""
    shared_prefixes: list[tuple[int, int, int]] = field(default_factory=list)
    """(first request, number of requests, prefix length) of runs of consecutive requests
    whose first prefix-length KV slots are the same slots (a beam search's beams share
    their prompt): a backend may read those keys once for all of them, or ignore this."""

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_list)
