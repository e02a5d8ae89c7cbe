"""Decode steps on the fused CPU kernels, beside ``cuda_graph_runner.py`` (the GPU's way of
taking Python out of a step).

A decoder layer whose parts are Llama's block (``LlamaAttention`` without q/k norms or
biases, declaring no sliding window, softcap or partial rotation; a gated SiLU MLP; one
tensor-parallel rank) runs its decode step as one call of the
kernels (``models/layers/cpu_decode_layer.py``); where every layer does and they agree in
shape, all of them run as one call (``models/layers/cpu_decode_stack.py``). Each step asks
again whether it can (the kernels on, the step's rows and dtype, the pool, the attention
backend); a layer whose step cannot runs its modules. Either way the hidden states, the
logits and the stored KV equal the modules' to the bit, so the choice is the runner's alone
and the model files know nothing of it.
"""

from __future__ import annotations

import torch

from radixlm.kernels.forward_batch import ForwardBatch
from radixlm.models.decoder_lm import DecoderOnlyLM
from radixlm.models.layers.cpu_decode_layer import FusedDecodeLayer
from radixlm.models.layers.cpu_decode_stack import FusedDecodeStack
from radixlm.models.layers.mlp import GatedMLP
from radixlm.models.llama import LlamaAttention, LlamaDecoderLayer


def fused_decode_layer(layer: torch.nn.Module) -> FusedDecodeLayer | None:
    """``layer``'s decode step as one call of the fused kernels, where its parts allow it."""
    if not isinstance(layer, LlamaDecoderLayer):
        return None
    attn, mlp = layer.self_attn, layer.mlp
    if (type(attn) is not LlamaAttention or type(mlp) is not GatedMLP
            or attn.q_norm is not None or attn.o_proj.tp.size != 1
            or mlp.down_proj.tp.size != 1):
        return None
    # The kernels attend over every cached key, unscaled scores, a whole-head rotation and a
    # SiLU gate: a layer declaring otherwise runs its modules.
    if (attn.attn.sliding_window is not None or attn.attn.logit_softcap is not None
            or attn.rotary_dim != attn.head_dim or mlp.activation != "silu"):
        return None
    return FusedDecodeLayer.build(
        attn.attn.layer_id, layer.input_layernorm, layer.post_attention_layernorm,
        (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj),
        attn.num_heads, attn.num_kv_heads, attn.attn.scaling)


class CpuDecodeRunner:
    """A model's decode steps with its fused layers (``layers``: each decoder layer's fused
    step, or None) and, where they stack, all of them in one call (``stack``)."""

    def __init__(self, model: DecoderOnlyLM, layers: list[FusedDecodeLayer | None]):
        self.model = model
        self.layers = layers
        self.stack = FusedDecodeStack.build(layers)

    @classmethod
    def build(cls, model: torch.nn.Module) -> CpuDecodeRunner | None:
        """The runner of ``model``'s decode steps, or None where no layer has a fused step."""
        if not isinstance(model, DecoderOnlyLM):
            return None
        layers = [fused_decode_layer(layer) for layer in model.layers]
        if all(layer is None for layer in layers):
            return None
        return cls(model, layers)

    def run(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """The decode step's hidden states (B, hidden), as ``model`` computes them."""
        model = self.model
        x, rope = model.embed(forward_batch.input_ids, forward_batch.positions)
        stacked = None if self.stack is None else self.stack.run(rope, x, forward_batch)
        if stacked is not None:
            x, residual = stacked
        else:
            residual = None
            for module, fused in zip(model.layers, self.layers):
                out = None if fused is None else fused.run(rope, x, residual, forward_batch)
                x, residual = out if out is not None else module(rope, x, residual,
                                                                 forward_batch)
        return model.final_norm(x, residual)
