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
from torch import nn
from transformers import PretrainedConfig

from radixlm.kernels.forward_batch import ForwardBatch
from radixlm.models.decoder_lm import DecoderOnlyLM
from radixlm.models.layers.layernorm import RMSNorm
from radixlm.models.layers.mla import MultiHeadLatentAttention
from radixlm.models.layers.mlp import GatedMLP
from radixlm.models.layers.moe import MoEBlock
from radixlm.models.weight_loading import load_named_weights

SUPPORTED_ACTIVATIONS = ("silu",)


def is_moe_layer(config: PretrainedConfig, layer_id: int) -> bool:
    """MoE from layer ``first_k_dense_replace`` on (as transformers builds DeepSeek)."""
    return bool(getattr(config, "n_routed_experts", None)) and (
        layer_id >= (getattr(config, "first_k_dense_replace", 0) or 0)
    )


class DeepseekDecoderLayer(nn.Module):
    def __init__(
        self, config: PretrainedConfig, layer_id: int, rope_interleaved: bool,
        trained_context: int,
    ):
        super().__init__()
        self.self_attn = MultiHeadLatentAttention(
            config, layer_id, rope_interleaved, trained_context
        )
        if is_moe_layer(config, layer_id):
            self.mlp = MoEBlock.for_deepseek(config)
        else:
            self.mlp = GatedMLP(
                config.hidden_size, config.intermediate_size,
                bias=bool(getattr(config, "mlp_bias", False)),
            )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
        residual: torch.Tensor | None, forward_batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this block's output, the residual stream before it is added)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(rope, h, forward_batch)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DeepseekV2ForCausalLM(DecoderOnlyLM):
    def __init__(self, config: PretrainedConfig, max_position: int):
        act = getattr(config, "hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported; supported: "
                             f"{SUPPORTED_ACTIVATIONS}")
        super().__init__(config, max_position, rope_head_dim=config.qk_rope_head_dim)

    def make_layer(self, config: PretrainedConfig, layer_id: int) -> DeepseekDecoderLayer:
        trained_context = getattr(config, "max_position_embeddings", self.max_position)
        return DeepseekDecoderLayer(config, layer_id, self.rope_interleaved(config),
                                    trained_context)

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
