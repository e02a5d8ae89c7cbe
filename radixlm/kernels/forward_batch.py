"""What one forward pass over a batch of requests needs to know: the shared batch descriptor.

Models, attention backends and the model runner all read it; nothing in it is per layer.
Tokens of all requests are packed one after another (ragged, no padding): request ``b``
owns ``extend_seq_lens[b]`` consecutive rows of ``input_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from radixlm.kernels.attention.attention_backend import AttentionBackend


class ForwardMode(Enum):
    EXTEND = auto()
    """New tokens of each request (a whole prompt, a chunk, or the part after a cache hit)."""
    DECODE = auto()
    """Exactly one new token per request."""


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
    attn_backend: AttentionBackend
    # Host copies, so backends plan without device syncs.
    seq_lens_list: list[int] = field(default_factory=list)
    extend_seq_lens_list: list[int] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_list)
