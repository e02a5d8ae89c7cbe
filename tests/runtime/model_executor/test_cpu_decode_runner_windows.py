"""A decoder layer whose attention has a sliding window or a logit softcap gets no fused
decode step: the kernels' decode attention sees every key of the request, uncapped."""

from __future__ import annotations

import pytest

from radixlm.models.model_config import ModelConfig
from radixlm.runtime.model_executor.cpu_decode_runner import fused_decode_layer
from radixlm.runtime.model_executor.model_runner import ModelRunner
from radixlm.runtime.server_args import ServerArgs


@pytest.mark.parametrize("attribute, value", [("sliding_window", 4), ("logit_softcap", 30.0)])
def test_windowed_or_softcapped_layers_have_no_fused_decode_step(tiny_model_dir, attribute,
                                                                 value):
    path = str(tiny_model_dir())
    runner = ModelRunner(ServerArgs(path, dtype="float32", max_total_tokens=256),
                         ModelConfig.from_path(path))
    first, second = runner.model.layers[:2]
    assert fused_decode_layer(first) is not None  # a plain Llama layer has one
    setattr(first.self_attn.attn, attribute, value)
    assert fused_decode_layer(first) is None
    assert fused_decode_layer(second) is not None
