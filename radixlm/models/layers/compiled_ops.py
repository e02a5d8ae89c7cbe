"""The operators a graph traced by torch.compile holds as opaque calls, so that what runs
fastest eagerly runs the same way compiled, and inductor fuses only what lies between them:

- ``radixlm::paged_attention``: a layer's attention backend, whose metadata (built on the
  host, per batch, from Python lists) never enters a graph;
- ``radixlm::packed_matmul``: a projection through its packed weight (the fused CPU kernels'
  column pairs, oneDNN's blocked layout, int8 or half weights), whose tensors a graph need
  not understand;
- ``radixlm::kernel_matmul`` (beside ``plain_matmul`` in ``weight_formats.py``, which it
  calls): a projection through a plain weight while the fused CPU kernels are on.

The first two find what they need, the pass's ``ForwardBatch``, the model's attention
layers by id and its packed weights by key, in the state a compiled pass leaves for them
(``compiled_pass``), per thread. While torch.compile traces, the layers call these in place
of their eager paths (``torch.compiler.is_compiling()``); eagerly nothing here runs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from radixlm.kernels.forward_batch import ForwardBatch

_pass_state = threading.local()


@contextmanager
def compiled_pass(forward_batch: ForwardBatch, layers: Mapping[int, Any],
                  packed_weights: Mapping[int, Any]) -> Iterator[None]:
    """Runs a compiled model's pass over ``forward_batch``: its operators attend with this
    batch and the attention layers ``layers`` maps their ids to, and multiply through the
    packed weights ``packed_weights`` maps their keys to (``Linear.packed_key``)."""
    _pass_state.batch, _pass_state.layers = forward_batch, layers
    _pass_state.packed_weights = packed_weights
    try:
        yield
    finally:
        _pass_state.batch = _pass_state.layers = _pass_state.packed_weights = None


def _state(name: str) -> Any:
    value = getattr(_pass_state, name, None)
    if value is None:
        raise RuntimeError("radixlm's compiled operators run inside compiled_pass only")
    return value


@torch.library.custom_op("radixlm::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                    v_head_dim: int) -> torch.Tensor:
    """Layer ``layer_id``'s attention over the pass's batch: stores the new K/V in the pool
    and returns (T, H, v_head_dim), contiguous.

    The store is a side effect the operator does not declare (the pool is not an argument):
    sound because each layer's call takes the previous layer's output, so no graph can
    reorder, merge or drop these calls, and only they touch the pool within a pass."""
    batch = _state("batch")
    layer = _state("layers")[layer_id]
    return batch.attn_backend.forward(q, k, v, layer, batch).contiguous()


@paged_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
      v_head_dim: int) -> torch.Tensor:
    return q.new_empty(*q.shape[:-1], v_head_dim)


@torch.library.custom_op("radixlm::packed_matmul", mutates_args=())
def packed_matmul(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    """x (T, in) @ the packed weight ``key``, transposed -> (T, out_features), contiguous."""
    return _state("packed_weights")[key].matmul(x).contiguous()


@packed_matmul.register_fake
def _(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)
