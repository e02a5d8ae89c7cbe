"""DeepSeek-V2 (DeepSeek-AI 2024) and DeepSeek-V3 (DeepSeek-AI 2024): MLA + mixture of experts.

A pre-norm decoder like Llama's, with multi-head latent attention
(``layers/mla.py``) in every layer and a feed-forward block that is a dense SwiGLU MLP for
the first ``first_k_dense_replace`` layers and a ``MoEBlock`` (routed + shared experts)
after them. V2 routes with a softmax (greedy or group-limited); V3 with a sigmoid and a
score-correction bias (``MoEBlock.for_deepseek`` reads which from the config). V2-Lite
has no q-LoRA (``q_lora_rank`` None: one ``q_proj``).

RoPE: both rotate interleaved pairs of the rope dims (V2 as complex numbers, V3 with
``rope_interleave``, its default); the attention layer turns them into the rotate-half
layout at load time. The KV pool is the latent layout (``MLATokenToKVPool``):
``ModelConfig.kv_lora_rank`` tells the model runner so.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from transformers import PretrainedConfig

from radixlm.models.decoder_lm import DecoderOnlyLM
from radixlm.models.layers.mla import MultiHeadLatentAttention
from radixlm.models.layers.moe import MoEBlock
from radixlm.models.llama import LlamaDecoderLayer
from radixlm.models.weight_loading import load_named_weights

SUPPORTED_ACTIVATIONS = ("silu",)


def is_moe_layer(config: PretrainedConfig, layer_id: int) -> bool:
    """MoE from layer ``first_k_dense_replace`` on (as transformers builds DeepSeek)."""
    return bool(getattr(config, "n_routed_experts", None)) and (
        layer_id >= (getattr(config, "first_k_dense_replace", 0) or 0)
    )


class DeepseekV2ForCausalLM(DecoderOnlyLM):
    def __init__(self, config: PretrainedConfig, max_position: int):
        act = getattr(config, "hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported; supported: "
                             f"{SUPPORTED_ACTIVATIONS}")
        super().__init__(config, max_position, rope_head_dim=config.qk_rope_head_dim)

    def make_layer(self, config: PretrainedConfig, layer_id: int) -> LlamaDecoderLayer:
        """Llama's pre-norm block with latent attention and, from layer
        ``first_k_dense_replace`` on, the MoE block."""
        trained_context = getattr(config, "max_position_embeddings", self.max_position)
        attn = MultiHeadLatentAttention(config, layer_id, self.rope_interleaved(config),
                                        trained_context)
        mlp = MoEBlock.for_deepseek(config) if is_moe_layer(config, layer_id) else None
        return LlamaDecoderLayer(config, layer_id, mlp=mlp, attn=attn)

    @staticmethod
    def rope_interleaved(config: PretrainedConfig) -> bool:
        """V2 always rotates interleaved pairs (its complex-number RoPE)."""
        return True

    # Checkpoint tensors that land in a shard of a stacked (fused) parameter: the dense
    # MLPs and the shared experts. Routed experts are stacked by ``MoEBlock`` itself.
    stacked_params = {
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads the checkpoint, then prepares each attention layer's absorbed weights."""
        load_named_weights(self, _skip_multi_token_prediction(weights, self.config),
                           self.stacked_params)
        for layer in self.layers:
            layer.self_attn.process_weights_after_loading()


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3: the V2 decoder with V3's sigmoid router (chosen by ``model_type``)."""

    @staticmethod
    def rope_interleaved(config: PretrainedConfig) -> bool:
        return bool(getattr(config, "rope_interleave", True))


def _skip_multi_token_prediction(
    weights: Iterable[tuple[str, torch.Tensor]], config: PretrainedConfig
) -> Iterable[tuple[str, torch.Tensor]]:
    """DeepSeek-V3 checkpoints carry their multi-token-prediction module as extra layers
    (``model.layers.{num_hidden_layers + i}.*``); next-token serving does not use them."""
    for name, tensor in weights:
        parts = name.split(".", 3)
        if parts[:2] == ["model", "layers"] and int(parts[2]) >= config.num_hidden_layers:
            continue
        yield name, tensor
