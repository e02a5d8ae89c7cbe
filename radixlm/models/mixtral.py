"""Mixtral (Jiang et al. 2024, "Mixtral of Experts"): the Llama/Mistral decoder whose
feed-forward block is a sparse mixture of eight SwiGLU experts, two per token.

Attention, norms, RoPE and the output head are ``radixlm.models.llama``'s; every layer's
MLP is an ``MoEBlock`` (softmax router, top-k renormalised, no shared expert).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from transformers import PretrainedConfig

from radixlm.models.layers.moe import MoEBlock
from radixlm.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    """Token ids -> hidden states; checkpoint names ``block_sparse_moe.*`` load into ``mlp``."""

    def make_layer(self, config: PretrainedConfig, layer_id: int) -> LlamaDecoderLayer:
        return LlamaDecoderLayer(config, layer_id, mlp=MoEBlock.for_mixtral(config),
                                 sliding_window=self.layer_window(layer_id))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_renamed(weights))


def _renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Mixtral checkpoints call the MoE block ``block_sparse_moe``; the decoder calls it ``mlp``."""
    for name, tensor in weights:
        yield name.replace(".block_sparse_moe.", ".mlp."), tensor
