"""Phi-3 (Abdin et al. 2024, "Phi-3 Technical Report"): the Llama decoder with fused
checkpoint projections and LongRoPE.

The block is Llama's (``radixlm.models.llama``); what differs is at the edges:

- the checkpoint stores q, k and v as one ``qkv_proj`` tensor (rows q | k | v) and gate and
  up as one ``gate_up_proj`` (rows gate | up). ``load_weights`` cuts them into the named
  shards of the stacked layers, so tensor parallelism slices them like Llama's;
- RoPE may be ``longrope`` (``su`` in older configs: per-dim short and long factors,
  ``layers/rope_scaling.py``) and may rotate only ``partial_rotary_factor`` of each head;
- with ``sliding_window`` set, every layer attends to its W most recent keys.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from radixlm.models.layers.rotary_embedding import RotaryEmbedding
from radixlm.models.llama import LlamaForCausalLM
from radixlm.models.model_config import rope_parameters


def phi3_rope_parameters(config: PretrainedConfig) -> dict[str, Any]:
    """The config's RoPE settings (``model_config.rope_parameters``), with the original
    context LongRoPE switches at taken from the config where 4.x configs keep it."""
    params = rope_parameters(config)
    original = getattr(config, "original_max_position_embeddings", None)
    if original and not params.get("original_max_position_embeddings"):
        params["original_max_position_embeddings"] = original
    return params


def rotary_dim(config: PretrainedConfig) -> int:
    """The leading dims of each head RoPE rotates: head_dim * ``partial_rotary_factor``
    (transformers 5 keeps the factor in ``rope_parameters``, 4.x on the config)."""
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads)
    factor = rope_parameters(config).get("partial_rotary_factor")
    if factor is None:
        factor = getattr(config, "partial_rotary_factor", None) or 1.0
    dim = int(head_dim * factor)
    if dim % 2 or not 0 < dim <= head_dim:
        raise ValueError(f"partial_rotary_factor {factor} gives {dim} rotated dims of "
                         f"head_dim {head_dim}; it must be an even count in (0, head_dim]")
    return dim


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3: token ids -> hidden states; fused ``qkv_proj`` / ``gate_up_proj`` checkpoints."""

    def __init__(self, config: PretrainedConfig, max_position: int):
        activation = getattr(config, "hidden_act", "silu")
        if activation != "silu":
            raise ValueError(f"Phi-3 hidden_act {activation!r} is not supported (only 'silu')")
        super().__init__(config, max_position, rope_head_dim=rotary_dim(config))

    def make_rotary(self, config: PretrainedConfig, rope_head_dim: int,
                    max_position: int) -> nn.Module:
        return RotaryEmbedding(
            rope_head_dim, max_position, phi3_rope_parameters(config),
            trained_context=getattr(config, "max_position_embeddings", max_position),
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(split_fused(weights, self.config))


def split_fused(
    weights: Iterable[tuple[str, torch.Tensor]], config: PretrainedConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Phi-3's fused checkpoint tensors as Llama's separate ones: ``self_attn.qkv_proj.*``
    -> ``q_proj`` (H * D rows), ``k_proj``, ``v_proj`` (H_kv * D each); ``mlp.gate_up_proj.*``
    -> ``gate_proj``, ``up_proj`` (I rows each). Other tensors pass unchanged."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    qkv_rows = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    for name, tensor in weights:
        if ".self_attn.qkv_proj." in name:
            if tensor.shape[0] != sum(qkv_rows):
                raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows; "
                                 f"q | k | v need {sum(qkv_rows)}")
            for part, shard in zip(("q_proj", "k_proj", "v_proj"),
                                   tensor.split(qkv_rows, dim=0), strict=True):
                yield name.replace(".qkv_proj.", f".{part}."), shard
        elif ".mlp.gate_up_proj." in name:
            if tensor.shape[0] != 2 * config.intermediate_size:
                raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows; "
                                 f"gate | up need {2 * config.intermediate_size}")
            gate, up = tensor.chunk(2, dim=0)
            yield name.replace(".gate_up_proj.", ".gate_proj."), gate
            yield name.replace(".gate_up_proj.", ".up_proj."), up
        else:
            yield name, tensor
