"""Decode steps on the fused CPU kernels, beside ``cuda_graph_runner.py`` (the GPU's way of
taking Python out of a step).

A decoder layer whose parts are Llama's block (``LlamaAttention`` without q/k norms or
biases, declaring no sliding window, softcap or partial rotation; a gated SiLU MLP; one
tensor-parallel rank) runs its decode step as one call of the
kernels (``models/layers/cpu_decode_layer.py``); where every layer does and they agree in
shape, all of them run as one call (``models/layers/cpu_decode_stack.py``). Gemma's sandwich
layers run so too, all of them in one call (``models/layers/cpu_sandwich_decode.py``), or
none fused. Each step asks
again whether it can (the kernels on, the step's rows and dtype, the pool, the attention
backend); a layer whose step cannot runs its modules. Either way the hidden states, the
logits and the stored KV equal the modules' to the bit, so the choice is the runner's alone
and the model files know nothing of it.
"""

from __future__ import annotations

import torch

from radixlm.kernels.forward_batch import ForwardBatch
from radixlm.models.decoder_lm import DecoderOnlyLM
from radixlm.models.gemma import GemmaDecoderLayer
from radixlm.models.layers.cpu_decode_layer import FusedDecodeLayer
from radixlm.models.layers.cpu_decode_stack import FusedDecodeStack
from radixlm.models.layers.cpu_sandwich_decode import (
    GELU_APPROXIMATE,
    FusedSandwichStack,
    SandwichLayerParts,
)
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


def sandwich_parts(layer: torch.nn.Module) -> SandwichLayerParts | None:
    """A Gemma layer's parts for the fused sandwich step, where the kernels serve them."""
    if type(layer) is not GemmaDecoderLayer:
        return None
    attn, mlp = layer.self_attn, layer.mlp
    if (type(attn) is not LlamaAttention or type(mlp) is not GatedMLP
            or attn.o_proj.tp.size != 1 or mlp.down_proj.tp.size != 1
            or attn.rotary_dim != attn.head_dim or mlp.activation not in GELU_APPROXIMATE):
        return None
    norms = (layer.input_layernorm, layer.post_attention_layernorm,
             layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm)
    if attn.q_norm is not None:
        norms += (attn.q_norm, attn.k_norm)
    return SandwichLayerParts(attn.attn, norms,
                              (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj),
                              layer.layer_type, mlp.activation)


def fused_sandwich_stack(model: DecoderOnlyLM) -> FusedSandwichStack | None:
    """All of ``model``'s layers as one fused sandwich step, where they allow it."""
    if not len(model.layers) or type(model.layers[0]) is not GemmaDecoderLayer:
        return None
    return FusedSandwichStack.build([sandwich_parts(layer) for layer in model.layers])


class CpuDecodeRunner:
    """A model's decode steps with its fused layers (``layers``: each decoder layer's fused
    step, or None) and, where they stack, all of them in one call (``stack``); or a Gemma
    model's sandwich layers, all in one call (``sandwich``; ``layers`` all None)."""

    def __init__(self, model: DecoderOnlyLM, layers: list[FusedDecodeLayer | None],
                 sandwich: FusedSandwichStack | None = None):
        self.model = model
        self.layers = layers
        self.stack = FusedDecodeStack.build(layers)
        self.sandwich = sandwich

    @classmethod
    def build(cls, model: torch.nn.Module) -> CpuDecodeRunner | None:
        """The runner of ``model``'s decode steps, or None where no layer has a fused step."""
        if not isinstance(model, DecoderOnlyLM):
            return None
        layers = [fused_decode_layer(layer) for layer in model.layers]
        sandwich = fused_sandwich_stack(model)
        if all(layer is None for layer in layers) and sandwich is None:
            return None
        return cls(model, layers, sandwich)

    def run(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """The decode step's hidden states (B, hidden), as ``model`` computes them."""
        model = self.model
        x, rope = model.embed(forward_batch.input_ids, forward_batch.positions)
        whole = self.stack if self.stack is not None else self.sandwich  # all layers at once
        stacked = None if whole is None else whole.run(rope, x, forward_batch)
        if stacked is not None:
            x, residual = stacked
        else:
            residual = None
            for module, fused in zip(model.layers, self.layers):
                out = None if fused is None else fused.run(rope, x, residual, forward_batch)
                x, residual = out if out is not None else module(rope, x, residual,
                                                                 forward_batch)
        return model.final_norm(x, residual)
