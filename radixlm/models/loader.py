"""Builds a model from a Hugging Face directory: config -> class -> weights, in the chosen dtype."""

from __future__ import annotations

import torch
from torch import nn

from radixlm.models.model_config import ModelConfig
from radixlm.models.registry import model_class
from radixlm.models.weight_loading import iterate_safetensors, safetensors_files


def load_model(
    config: ModelConfig, dtype: torch.dtype, device: torch.device, max_position: int
) -> nn.Module:
    """The model of ``config.architecture`` with its checkpoint weights, in eval mode.

    ``max_position`` bounds the positions the model will see (the serving context length);
    RoPE tables are sized by it.
    """
    cls = model_class(config.architecture)
    files = safetensors_files(config.path)
    with torch.device(device):
        model = cls(config.hf_config, max_position=max_position)
    model.load_weights(iterate_safetensors(files))
    # RoPE tables stay float32; parameters take the serving dtype, except those marked
    # ``keep_float32`` (e.g. an MoE router's score correction bias).
    for param in model.parameters():
        if not getattr(param, "keep_float32", False):
            param.data = param.data.to(dtype)
    return model.train(False).requires_grad_(False)
