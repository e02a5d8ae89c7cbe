"""A pre-norm decoder layer's decode step as one call of the fused CPU kernels.

A batch-1 decode step of the default model spends about a quarter of its time in Python
between its kernels: module calls, views, the attention backend's dispatch (the time a
layer takes there is in benchmarks/RESULTS.md). Where every kernel of the layer's step is
one of the fused CPU kernels' or torch's
linear (attention over the pool, ``paged_decode_attention``; each projection as its
``Linear`` multiplies it for the step's rows, ``Linear.fused_projection``: weights by column
pairs, int8 or float16 weight-only formats, a GGUF file's blocks, float32 or bfloat16 rows),
the kernels'
``decode_layer`` runs the whole step in C++: the same kernels, in the same order, on the
same operands, so the layer's outputs and the KV it stores equal the module path's to the
bit (tests/models/layers/test_cpu_decode_layer.py).

``FusedDecodeLayer.build`` says whether a layer's parts allow it (Llama's block: no biases,
no q/k norms, one tensor-parallel rank, a gated SiLU MLP); ``run`` says per step whether
the step does (the kernels on, the serving dtype, every projection's path at the step's
rows, the attention backend's decode over the pool, an MHA pool), else returns None and the
modules run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from radixlm.kernels.cpu_ops import fused_ops
from radixlm.kernels.forward_batch import ForwardBatch
from radixlm.kv_cache.memory_pool import MHATokenToKVPool
from radixlm.models.layers.layernorm import RMSNorm
from radixlm.models.layers.linear import Linear
from radixlm.models.layers.weight_formats import FusedProjection

# decode_layer's kernels, weights and scales arguments (a list of four each, a layer) and
# its gguf_parts (the GGUF projections' blocks, which their scales index).
ProjectionOperands = tuple[list[int], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]
_NO_ADAPTERS = [torch.empty(0)] * 5  # a projection's lora_add operands where it has none


def lora_operands(forward_batch: ForwardBatch, projections: Sequence[Linear], known: dict
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """decode_layer's (lora_pass, lora_weights) for ``projections`` in a step: the step's
    adapter groups and five ``lora_add`` operands a projection (empty ones where it has no
    adapters); both empty where no row of the step uses an adapter. The operands are kept
    in ``known`` while every projection holds the adapter weights it held then (a slot is
    loaded in place, so they change only if a projection's ``lora`` is replaced)."""
    if forward_batch.lora is None:
        return [], []
    held = tuple(projection.lora for projection in projections)
    cached = known.get("lora")
    if cached is None or any(a is not b for a, b in zip(cached[0], held, strict=True)):
        weights = []
        for lora in held:
            weights += _NO_ADAPTERS if lora is None else lora.kernel_operands()
        known["lora"] = cached = (held, weights)
    groups = forward_batch.lora.groups()
    return [groups.rows, groups.starts, groups.slots], cached[1]


def append_products(operands: ProjectionOperands, products: Sequence[FusedProjection]) -> None:
    """Appends ``products`` to a call's ``operands``: a GGUF projection's parts to its
    gguf_parts, its table's indices moved past the parts already there."""
    kernels, weights, scales, parts = operands
    for product in products:
        kernels.append(product.kernel)
        weights.append(product.weight)
        if product.parts:
            scales.append(product.scales + torch.tensor([0, len(parts)]))
            parts.extend(product.parts)
        else:
            scales.append(product.scales)


@dataclass(frozen=True, eq=False)
class FusedDecodeLayer:
    """One layer's fused decode step over the layer's own modules, read at every step (so a
    projection packed or laid out anew after ``build`` is multiplied as it now is)."""

    layer_id: int
    input_norm: RMSNorm
    post_norm: RMSNorm
    projections: tuple[Linear, Linear, Linear, Linear]  # qkv (q | k | v), o, gate_up, down
    heads: int
    kv_heads: int
    scale: float
    _known: dict = field(default_factory=dict)  # see products and lora_operands

    @classmethod
    def build(cls, layer_id: int, input_norm: RMSNorm, post_norm: RMSNorm,
              projections: tuple[Linear, Linear, Linear, Linear], heads: int, kv_heads: int,
              scale: float) -> FusedDecodeLayer | None:
        """The fused step of a layer whose ``projections`` are (qkv, o, gate_up, down) of one
        tensor-parallel rank, or None where one of them has a bias or the norms differ in
        eps."""
        if any(p.bias is not None for p in projections) or input_norm.eps != post_norm.eps:
            return None
        return cls(layer_id, input_norm, post_norm, projections, heads, kv_heads, scale)

    def run(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
            residual: torch.Tensor | None,
            forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layer's (output, residual stream) for x (T, hidden), as its modules compute
        them, and its new K/V stored; None where this step cannot run fused."""
        kernels = fused_ops.for_tensor(x)
        input_norm, post_norm = self.input_norm.weight, self.post_norm.weight
        if kernels is None or not x.dtype == input_norm.dtype == post_norm.dtype:
            return None
        products = self.products(x.shape[0], x.dtype)
        if products is None:
            return None
        pool = forward_batch.kv_pool
        if type(pool) is not MHATokenToKVPool:
            return None
        tables = forward_batch.attn_backend.pool_decode_tables(forward_batch)
        if tables is None:
            return None
        k_buffer, v_buffer = pool.get_kv(self.layer_id)
        lora_pass, lora_weights = lora_operands(forward_batch, self.projections, self._known)
        kernel_kinds, weights, scales, gguf_parts = products
        return kernels.decode_layer(
            x, x if residual is None else residual, residual is not None,
            input_norm, post_norm, self.input_norm.eps, kernel_kinds, weights, scales, *rope,
            k_buffer, v_buffer, forward_batch.out_cache_loc, *tables, self.heads,
            self.kv_heads, self.scale, lora_pass, lora_weights, gguf_parts)

    def weights(self) -> list:
        """The projections' weights as they multiply them now: each one's packed weight, or
        its plain one."""
        return [p.weight if p.packed is None else p.packed for p in self.projections]

    def products(self, rows: int, dtype: torch.dtype) -> ProjectionOperands | None:
        """The projections' kernels, weights and scales for passes of ``rows`` rows of
        ``dtype`` (``Linear.fused_projection``), or None where one runs none of the kernels.
        Kept per (rows, dtype) while every projection holds the weight it held then (a
        weight packed or laid out anew is asked again): nothing else they depend on changes
        between decode steps (the plan's ``prompt_pass``, which oneDNN's layout heeds, is
        only entered for prompt passes)."""
        weights = self.weights()
        known = self._known.get((rows, dtype))
        if known is not None and all(a is b for a, b in zip(known[0], weights)):
            return known[1]
        products = self.fused_products(rows, dtype)
        operands = None
        if products is not None:
            operands = ([], [], [], [])
            append_products(operands, products)
        self._known[(rows, dtype)] = (weights, operands)
        return operands

    def fused_products(self, rows: int, dtype: torch.dtype) -> list[FusedProjection] | None:
        """Each projection as the kernels multiply it for passes of ``rows`` rows of
        ``dtype`` (``Linear.fused_projection``), or None where one runs none of them."""
        products = [p.fused_projection(rows, dtype) for p in self.projections]
        return None if any(p is None for p in products) else products
