"""A Gemma model's decoder layers' decode step as one call of the fused CPU kernels.

Gemma's "sandwich" block (``models/gemma.py``: four norms a layer, q/k norms in Gemma 3, a
GELU gate, local and global layers with their own RoPE tables and windows) is not Llama's,
so ``cpu_decode_layer``'s step does not fit it; its layers ran their modules, with the
Python between their kernels a large share of a batch-1 step (benchmarks/RESULTS.md). The
kernels' ``sandwich_decode_layers`` runs every layer's step in C++: the same kernels, in
the same order, on the same operands as the modules give them, so the hidden states and the
stored KV equal the modules' to the bit (tests/models/layers/test_cpu_sandwich_decode.py).

What differs between layers travels per layer: the RoPE table of the layer's kind, and the
attention backend's ``layer_decode_tables`` for the layer (where its new K/V go and which
keys it reads: a sliding layer's are its window's, under the pool's slot map). ``build``
says whether the layers allow it (``SandwichLayerParts``: no biases, one tensor-parallel
rank, whole-head rotation, a GELU gate, one eps, heads and scale); ``run`` says per step
whether the step does (the kernels on, the norms in the step's dtype, every projection's
path at the step's rows, the backend's tables for every layer, a plain or hybrid pool),
else returns None and the modules run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from radixlm.kernels.cpu_ops import fused_ops
from radixlm.kernels.forward_batch import ForwardBatch
from radixlm.kv_cache.hybrid_pool import HybridKVPool
from radixlm.kv_cache.memory_pool import MHATokenToKVPool
from radixlm.models.layers.cpu_decode_layer import (
    ProjectionOperands,
    append_products,
    lora_operands,
)
from radixlm.models.layers.layernorm import GemmaRMSNorm
from radixlm.models.layers.linear import Linear

GELU_APPROXIMATE = {"gelu_pytorch_tanh": "tanh", "gelu_tanh": "tanh", "gelu": "none"}
"""The gate activations the step takes, as F.gelu's ``approximate`` (``GATE_ACTIVATIONS``)."""
POOLS = (MHATokenToKVPool, HybridKVPool)
"""The pools whose ``set_kv`` is a plain write at the backend's write slots."""


@dataclass(frozen=True, eq=False)
class SandwichLayerParts:
    """One sandwich layer's modules, read at every step."""

    attention: nn.Module  # the layer's PagedAttention: layer_id, window, softcap, scaling
    norms: tuple[GemmaRMSNorm, ...]  # input, post-attention, pre-FF, post-FF[, q, k]
    projections: tuple[Linear, Linear, Linear, Linear]  # qkv (q | k | v), o, gate_up, down
    rope_kind: str  # the key of its RoPE table where the model's rope is one per kind
    activation: str  # the MLP's gate activation (GATE_ACTIVATIONS' name)

    def weights(self) -> list:
        """The projections' weights as they multiply them now (packed or plain)."""
        return [p.weight if p.packed is None else p.packed for p in self.projections]


@dataclass(frozen=True, eq=False)
class FusedSandwichStack:
    """The fused decode steps of a model's sandwich layers, in order, run as one call."""

    layers: tuple[SandwichLayerParts, ...] = field(repr=False)
    heads: int
    kv_heads: int
    scale: float
    eps: float
    _known: dict = field(default_factory=dict, repr=False)  # see _operands, lora_operands

    @classmethod
    def build(cls, layers: Sequence[SandwichLayerParts | None]) -> FusedSandwichStack | None:
        """The stack of ``layers`` (each decoder layer's parts, or None where a layer is not
        a sandwich layer the kernels serve), or None where one is None, a projection has a
        bias, or they differ in eps, heads, scale, activation or in having q/k norms."""
        if not layers or any(layer is None for layer in layers):
            return None

        def shared(layer: SandwichLayerParts) -> tuple:
            attention = layer.attention
            return (attention.num_heads, attention.num_kv_heads, attention.scaling,
                    len(layer.norms), GELU_APPROXIMATE[layer.activation])

        first = layers[0]
        eps = first.norms[0].eps
        for layer in layers:
            if (any(p.bias is not None for p in layer.projections)
                    or any(norm.eps != eps for norm in layer.norms)
                    or shared(layer) != shared(first)):
                return None
        attention = first.attention
        return cls(tuple(layers), attention.num_heads, attention.num_kv_heads,
                   attention.scaling, eps)

    def run(self, rope: tuple[torch.Tensor, torch.Tensor] | dict, x: torch.Tensor,
            forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The last layer's (output, residual stream) for the first layer's input x
        (T, hidden), as the layers compute them one by one, with every layer's new K/V
        stored; None where this step cannot run fused. ``rope``: the model's lookup, one
        (cos, sin) or one per layer kind."""
        kernels = fused_ops.for_tensor(x)
        pool = forward_batch.kv_pool
        if kernels is None or type(pool) not in POOLS:
            return None
        operands = self._operands(x.shape[0], x.dtype)
        if operands is None:
            return None
        backend = forward_batch.attn_backend
        tables, softcaps, ropes, kv_buffers = [], [], [], []
        by_kind = {}  # a layer's tables follow from its window, softcap and slot map
        for layer in self.layers:
            attention = layer.attention
            kind = (attention.sliding_window, attention.logit_softcap,
                    id(pool.slot_map_for(attention.layer_id)))
            layer_tables = by_kind.get(kind)
            if layer_tables is None:
                layer_tables = backend.layer_decode_tables(forward_batch, attention)
                if layer_tables is None:
                    return None
                by_kind[kind] = layer_tables
            tables += layer_tables[:3]
            softcaps.append(layer_tables.softcap)
            ropes += rope[layer.rope_kind] if isinstance(rope, dict) else rope
            kv_buffers += pool.get_kv(attention.layer_id)
        scales, (kernel_kinds, weights, projection_scales, gguf_parts) = operands
        lora_pass, lora_weights = lora_operands(
            forward_batch, [p for layer in self.layers for p in layer.projections], self._known)
        first = self.layers[0]
        return kernels.sandwich_decode_layers(
            x, scales, self.eps, kernel_kinds, weights, projection_scales, ropes, kv_buffers,
            tables, softcaps, self.heads, self.kv_heads, self.scale, len(first.norms) == 6,
            GELU_APPROXIMATE[first.activation], lora_pass, lora_weights, gguf_parts)

    def _operands(self, rows: int, dtype: torch.dtype,
                  ) -> tuple[list[torch.Tensor], ProjectionOperands] | None:
        """Every layer's six norm scales (float32; where the layers have no q/k norms, the layer's
        first two stand in their places, unread) and projections for passes of ``rows`` rows of
        ``dtype``, or None where a norm's weight is not of ``dtype`` (its module would not take
        the kernels) or a projection runs none of the kernels. Kept per (rows, dtype) while
        every norm weight is the tensor and version it was then and every projection holds the
        weight it held then."""
        norm_weights = [norm.weight for layer in self.layers for norm in layer.norms]
        held = norm_weights + [w for layer in self.layers for w in layer.weights()]
        versions = [weight._version for weight in norm_weights]
        known = self._known.get((rows, dtype))
        if (known is not None and known[1] == versions
                and all(a is b for a, b in zip(known[0], held, strict=True))):
            return known[2]
        operands = None
        if all(weight.dtype == dtype for weight in norm_weights):
            scales: list[torch.Tensor] = []
            products: ProjectionOperands = ([], [], [], [])
            operands = (scales, products)
            for layer in self.layers:
                layer_products = [p.fused_projection(rows, dtype) for p in layer.projections]
                if any(p is None for p in layer_products):
                    operands = None
                    break
                layer_scales = [norm.scale() for norm in layer.norms]
                scales += layer_scales + layer_scales[:6 - len(layer_scales)]
                append_products(products, layer_products)
        self._known[(rows, dtype)] = (held, versions, operands)
        return operands
