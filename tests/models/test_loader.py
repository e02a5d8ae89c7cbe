"""The loader's model building: a GGUF's model is built without running torch's init
functions (what it imports meanwhile: tests/models/gguf/test_native_weights.py)."""

from __future__ import annotations

import torch

from radixlm.models.loader import _without_init


def test_init_functions_are_no_ops_while_a_gguf_model_is_built_and_restored_after():
    weight = torch.zeros(4, 8)
    with _without_init(True):
        torch.nn.init.normal_(weight)
        linear = torch.nn.Linear(8, 4)  # its reset_parameters runs kaiming_uniform_
        assert not weight.any()
    torch.nn.init.normal_(weight)
    assert weight.any()
    with _without_init(False):
        torch.nn.init.zeros_(weight)
    assert not weight.any() and linear.weight.shape == (4, 8)
