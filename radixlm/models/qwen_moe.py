"""Qwen2-MoE (Qwen team 2024, Qwen1.5-MoE / Qwen2-57B-A14B) and Qwen3-MoE (Qwen team 2025):
the Qwen2 / Qwen3 decoders with mixture-of-experts feed-forward blocks.

- Qwen2-MoE: q/k/v bias (``qkv_bias``); each MoE block has, beside its routed experts, one
  shared expert whose output is scaled by sigmoid(shared_expert_gate(x)); routing weights
  are renormalised only if ``norm_topk_prob``.
- Qwen3-MoE: per-head q/k RMSNorm, no shared expert, ``norm_topk_prob`` (true in the
  released models).

Both place MoE blocks on layers with (i + 1) % ``decoder_sparse_step`` == 0 that are not
in ``mlp_only_layers``; the other layers keep a dense MLP of ``intermediate_size``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from radixlm.models.layers.mlp import GatedMLP
from radixlm.models.layers.moe import MoEBlock
from radixlm.models.llama import LlamaDecoderLayer, LlamaForCausalLM


def is_moe_layer(config: PretrainedConfig, layer_id: int) -> bool:
    """Whether layer ``layer_id`` has an MoE block, by the rule transformers applies."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (
        layer_id not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_id + 1) % step == 0
    )


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    qkv_bias = True
    moe_block = staticmethod(MoEBlock.for_qwen2_moe)

    def make_layer(self, config: PretrainedConfig, layer_id: int) -> LlamaDecoderLayer:
        mlp: nn.Module
        if is_moe_layer(config, layer_id):
            mlp = self.moe_block(config)
        else:
            mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        return LlamaDecoderLayer(
            config, layer_id, mlp=mlp,
            qkv_bias=bool(getattr(config, "qkv_bias", self.qkv_bias)), qk_norm=self.qk_norm,
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_renamed(weights))


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    qkv_bias = False
    qk_norm = True
    moe_block = staticmethod(MoEBlock.for_qwen3_moe)


def _renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Qwen2-MoE's ``mlp.shared_expert.*`` is ``MoEBlock.shared_experts`` (DeepSeek's name)."""
    for name, tensor in weights:
        yield name.replace(".mlp.shared_expert.", ".mlp.shared_experts."), tensor
