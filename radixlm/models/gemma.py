"""Gemma 2 (Gemma Team 2024, "Gemma 2: Improving Open Language Models at a Practical Size") and
Gemma 3's text decoder (Gemma Team 2025, "Gemma 3 Technical Report").

Llama's attention and gated MLP in a "sandwich" block: every sublayer's input and output
are normed, x + post_attn_norm(attn(input_norm(x))), then + post_ff_norm(mlp(pre_ff_norm(x))).
Gemma's departures from Llama, each where it enters:

- the token embedding is multiplied by sqrt(hidden), in the activations' dtype
  (``DecoderOnlyLM.embed_scale``); the output embedding is tied to it;
- RMSNorms scale by (1 + w), in float32 (``GemmaRMSNorm``; checkpoints keep w);
- the MLP gates through tanh-approximated GELU (GeGLU);
- queries are scaled by ``query_pre_attn_scalar``^-0.5, not head_dim^-0.5;
- local layers (``config.layer_types``; ``model_config.attention_windows``) attend to the
  W = ``sliding_window`` most recent keys, global ones to all;
- Gemma 2 soft-caps attention scores (``attn_logit_softcapping``, to the attention layer)
  and the final logits (``final_logit_softcapping``, in ``compute_logits``);
- Gemma 3 normalises each query and key head (QK-norm, replacing the softcaps) and gives
  its local layers their own RoPE: a shorter base, no scaling (``gemma3_rope_parameters``).

Gemma 3's multimodal checkpoints (``Gemma3ForConditionalGeneration``) are served as text
models: their text decoder, its tensors renamed from under ``language_model.``.

Invariant: a layer's ``layer_type`` picks both its RoPE table and (when the config has a
window) its window, so the two never disagree.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from radixlm.kernels.forward_batch import ForwardBatch
from radixlm.models.layers.layernorm import GemmaRMSNorm
from radixlm.models.layers.mlp import GatedMLP
from radixlm.models.layers.rotary_embedding import RotaryEmbedding
from radixlm.models.llama import LlamaAttention, LlamaForCausalLM

FULL, SLIDING = "full_attention", "sliding_attention"
Rope = tuple[torch.Tensor, torch.Tensor]


def layer_types(config: PretrainedConfig, sliding_layers: frozenset[int]) -> list[str]:
    """Each layer's kind, FULL or SLIDING: ``config.layer_types`` where the config has it,
    else the layers ``model_config.attention_windows`` found local."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    return [SLIDING if i in sliding_layers else FULL for i in range(config.num_hidden_layers)]


def gemma3_rope_parameters(config: PretrainedConfig) -> dict[str, dict[str, Any]]:
    """Gemma 3's RoPE settings per layer kind, each a dict with ``rope_type`` and
    ``rope_theta``. transformers 5 keeps them in ``rope_parameters[kind]``; 4.x configs have
    ``rope_theta`` and ``rope_scaling`` for the global layers and ``rope_local_base_freq``
    (unscaled) for the local ones."""
    params = getattr(config, "rope_parameters", None) or {}
    if FULL in params or SLIDING in params:
        by_kind = {kind: dict(params.get(kind) or {}) for kind in (FULL, SLIDING)}
    else:
        scaling = getattr(config, "rope_scaling", None)
        by_kind = {
            FULL: {**(scaling if isinstance(scaling, dict) else {}),
                   "rope_theta": getattr(config, "rope_theta", 1_000_000.0)},
            SLIDING: {"rope_theta": getattr(config, "rope_local_base_freq", 10_000.0)},
        }
    for kind_params in by_kind.values():
        kind_params["rope_type"] = (kind_params.get("rope_type") or kind_params.get("type")
                                    or "default")
    by_kind[FULL].setdefault("rope_theta", 1_000_000.0)
    by_kind[SLIDING].setdefault("rope_theta", 10_000.0)
    return by_kind


class LayerTypeRotary(nn.Module):
    """One rotary table per layer kind; ``lookup`` gives every layer the rows of all of them
    (a layer takes its own kind's, ``GemmaDecoderLayer.forward``)."""

    def __init__(self, head_dim: int, max_position: int, params: dict[str, dict[str, Any]],
                 trained_context: int):
        super().__init__()
        self.tables = nn.ModuleDict({
            kind: RotaryEmbedding(head_dim, max_position, kind_params, trained_context)
            for kind, kind_params in params.items()
        })

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, Rope]:
        """positions (T,) -> {kind: (cos, signed sin), each (T, 1, D)}."""
        return {kind: table.lookup(positions, dtype) for kind, table in self.tables.items()}


class GemmaDecoderLayer(nn.Module):
    """One Gemma block (the sandwich above); follows ``DecoderOnlyLM``'s layer contract."""

    def __init__(self, config: PretrainedConfig, layer_id: int, layer_type: str,
                 sliding_window: int | None, qk_norm: bool):
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = LlamaAttention(
            config, layer_id, qk_norm=qk_norm, norm=GemmaRMSNorm,
            scaling=config.query_pre_attn_scalar**-0.5, sliding_window=sliding_window,
            logit_softcap=getattr(config, "attn_logit_softcapping", None),
        )
        activation = (getattr(config, "hidden_activation", None)
                      or getattr(config, "hidden_act", None) or "gelu_pytorch_tanh")
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, activation=activation)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self, rope: Rope | dict[str, Rope], x: torch.Tensor, residual: torch.Tensor | None,
        forward_batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual: (T, hidden); the stream is x + residual (x alone for the first
        layer). Returns (post_ff_norm(mlp(...)), the stream after attention), whose sum is
        the stream after this layer."""
        if isinstance(rope, dict):
            rope = rope[self.layer_type]
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(rope, h, forward_batch))  # (T, hidden)
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2: token ids -> hidden states; soft-capped logits over the tied embedding."""

    qk_norm = False

    def __init__(self, config: PretrainedConfig, max_position: int):
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention (Gemma's embedding models) is not "
                             "supported: only causal language models are served")
        super().__init__(config, max_position)
        self.embed_scale = config.hidden_size**0.5
        self.final_logit_softcap = getattr(config, "final_logit_softcapping", None)

    def make_layer(self, config: PretrainedConfig, layer_id: int) -> GemmaDecoderLayer:
        kind = layer_types(config, self.sliding_layers)[layer_id]
        return GemmaDecoderLayer(config, layer_id, kind, self.layer_window(layer_id),
                                 qk_norm=self.qk_norm)

    def make_norm(self, config: PretrainedConfig) -> nn.Module:
        return GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's text decoder: Gemma 2 with QK-norm and a RoPE table per layer kind."""

    qk_norm = True

    def make_rotary(self, config: PretrainedConfig, rope_head_dim: int,
                    max_position: int) -> nn.Module:
        params = gemma3_rope_parameters(config)
        kinds = set(layer_types(config, self.sliding_layers))
        return LayerTypeRotary(
            rope_head_dim, max_position, {k: v for k, v in params.items() if k in kinds},
            trained_context=getattr(config, "max_position_embeddings", max_position),
        )


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma 3's multimodal checkpoints (4B and larger) served as text models: the text
    decoder alone, built from the config's ``text_config`` (``ModelConfig.text_config``),
    its weights read from under ``language_model.`` (the hub's layout) or
    ``model.language_model.`` (transformers' newer one). The vision tower's and the
    projector's tensors are not read; every other name must still match a parameter."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(text_decoder_weights(weights))


TEXT_DECODER_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                         "language_model.lm_head.": "lm_head."}
IMAGE_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                  "model.multi_modal_projector.")


def text_decoder_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """A multimodal checkpoint's text decoder tensors under the text model's names."""
    for name, tensor in weights:
        if name.startswith(IMAGE_PREFIXES):
            continue
        for prefix, replacement in TEXT_DECODER_PREFIXES.items():
            if name.startswith(prefix):
                name = replacement + name.removeprefix(prefix)
                break
        yield name, tensor
