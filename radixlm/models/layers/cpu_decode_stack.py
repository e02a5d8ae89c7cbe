"""A model's decoder layers' decode step as one call of the fused CPU kernels.

``cpu_decode_layer`` runs each layer's decode step as one kernel call; around those calls a
step still spent a seventh of a batch-1 forward in Python on the default model (30 layers:
the module calls, each layer's operand lookups and checks, the conversion of its call's
arguments). Where every layer has a fused step and
they share the norms' eps, the heads and the attention scale, the kernels' ``decode_layers``
runs them all in one call: each layer's step as ``decode_layer`` runs it, one after another
in C++, so the outputs and the stored KV equal the per-layer path's (and the modules') to
the bit (tests/models/layers/test_cpu_decode_layer.py); a forward is a little faster at
batch 1 and at 16 requests (benchmarks/RESULTS.md).

``FusedDecodeStack.build`` says whether the layers allow it; ``run`` says per step whether
the step does (the same conditions as a layer's ``FusedDecodeLayer.run``), else returns
None and the layers run one by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from radixlm.kernels.cpu_ops import fused_ops
from radixlm.kernels.forward_batch import ForwardBatch
from radixlm.kv_cache.memory_pool import MHATokenToKVPool
from radixlm.models.layers.cpu_decode_layer import (
    FusedDecodeLayer,
    ProjectionOperands,
    append_products,
    lora_operands,
)

# decode_layers' per-layer operands that a step's rows and dtype fix, layer after layer: the
# norms (input, post-attention) and the projections (kernels, weights, scales: four each).
StackOperands = tuple[list[torch.Tensor], ProjectionOperands]


@dataclass(frozen=True, eq=False)
class FusedDecodeStack:
    """The fused decode steps of a model's decoder layers, in order, run as one call."""

    layers: tuple[FusedDecodeLayer, ...] = field(repr=False)
    _known: dict = field(default_factory=dict, repr=False)  # see _operands, lora_operands

    @classmethod
    def build(cls, layers: Sequence[FusedDecodeLayer | None]) -> FusedDecodeStack | None:
        """The stack of ``layers`` (each decoder layer's fused step, or None where it has
        none), or None where one has none or they differ in eps, heads or scale."""
        if not layers or any(layer is None for layer in layers):
            return None
        first = layers[0]
        shared = (first.input_norm.eps, first.post_norm.eps, first.heads, first.kv_heads,
                  first.scale)
        if any((layer.input_norm.eps, layer.post_norm.eps, layer.heads, layer.kv_heads,
                layer.scale) != shared for layer in layers):
            return None
        return cls(tuple(layers))

    def run(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
            forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The last layer's (output, residual stream) for the first layer's input x
        (T, hidden), as the layers compute them one by one, with every layer's new K/V
        stored; None where this step cannot run fused."""
        kernels = fused_ops.for_tensor(x)
        pool = forward_batch.kv_pool
        if kernels is None or type(pool) is not MHATokenToKVPool:
            return None
        operands = self._operands(x.shape[0], x.dtype)
        if operands is None:
            return None
        tables = forward_batch.attn_backend.pool_decode_tables(forward_batch)
        if tables is None:
            return None
        kv_buffers = [b for layer in self.layers for b in pool.get_kv(layer.layer_id)]
        norms, (kernel_kinds, weights, scales, gguf_parts) = operands
        first = self.layers[0]
        lora_pass, lora_weights = lora_operands(
            forward_batch, [p for layer in self.layers for p in layer.projections], self._known)
        return kernels.decode_layers(
            x, norms, first.input_norm.eps, kernel_kinds, weights, scales, *rope, kv_buffers,
            forward_batch.out_cache_loc, *tables, first.heads, first.kv_heads, first.scale,
            lora_pass, lora_weights, gguf_parts)

    def _operands(self, rows: int, dtype: torch.dtype) -> StackOperands | None:
        """Every layer's norms and projections for passes of ``rows`` rows of ``dtype``, or
        None where a layer's step cannot run fused (its norms not of ``dtype``, a projection
        the kernels do not multiply: ``FusedDecodeLayer.products``). Kept per (rows, dtype)
        while every norm's and projection's weight is the one it was then (one pass over
        them a step, in place of each layer's own lookup)."""
        held = []
        for layer in self.layers:
            held += (layer.input_norm.weight, layer.post_norm.weight, *layer.weights())
        known = self._known.get((rows, dtype))
        if known is not None and all(a is b for a, b in zip(known[0], held, strict=True)):
            return known[1]
        norms: list[torch.Tensor] = []
        products: ProjectionOperands = ([], [], [], [])
        operands = (norms, products)
        for layer in self.layers:
            layer_products = layer.fused_products(rows, dtype)
            if (layer_products is None or layer.input_norm.weight.dtype != dtype
                    or layer.post_norm.weight.dtype != dtype):
                operands = None
                break
            norms += (layer.input_norm.weight, layer.post_norm.weight)
            append_products(products, layer_products)
        self._known[(rows, dtype)] = (held, operands)
        return operands
