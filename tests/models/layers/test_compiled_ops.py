"""The operators a compiled graph holds as calls (``compiled_ops``, ``weight_formats``'
``kernel_matmul``): inside a compiled pass
each is its layer's eager call, with that pass's batch, layers and packed weights, and
returns a contiguous result; outside one the first two refuse to guess."""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels.forward_batch import ForwardBatch, ForwardMode
from radixlm.models.layers.attention import PagedAttention
from radixlm.models.layers.compiled_ops import compiled_pass, packed_matmul, paged_attention
from radixlm.models.layers.linear import Linear
from radixlm.models.layers.weight_formats import (
    ConversionBuffer,
    Int8Weight,
    kernel_matmul,
    plain_matmul,
)


class RecordingBackend:
    """Attention that is a known function of its inputs and records each call's layer."""

    def __init__(self) -> None:
        self.layers: list[int] = []

    def forward(self, q, k, v, layer, forward_batch):
        self.layers.append(layer.layer_id)
        out = q * layer.scaling + v.repeat_interleave(2, dim=1)  # (T, H, D)
        return out.transpose(0, 1).contiguous().transpose(0, 1)  # not contiguous


def batch_with(backend) -> ForwardBatch:
    ids = torch.zeros(3, dtype=torch.int64)
    return ForwardBatch(ForwardMode.DECODE, ids, ids, ids, ids, ids + 1, ids, ids + 1,
                        torch.zeros(1, 1, dtype=torch.int64), None, backend, [1] * 3, [1] * 3)


def test_attention_inside_a_compiled_pass_is_the_layers_eager_call():
    backend = RecordingBackend()
    layers = {i: PagedAttention(i, 4, 2, 8, 0.5 + i) for i in range(2)}
    batch = batch_with(backend)
    q, k, v = torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    with compiled_pass(batch, layers, {}):
        out = paged_attention(q, k, v, 1, 8)
    assert out.is_contiguous() and backend.layers == [1]
    assert torch.equal(out, layers[1](q, k, v, batch))


def test_a_packed_projection_inside_a_compiled_pass_is_its_eager_call():
    layers = [Linear(32, 16, bias=False) for _ in range(2)]
    for layer in layers:
        layer.pack_weight(lambda weight: Int8Weight.pack(weight, ConversionBuffer()))
    assert layers[0].packed_key != layers[1].packed_key
    x = torch.randn(5, 32)
    table = {layer.packed_key: layer.packed for layer in layers}
    with compiled_pass(batch_with(RecordingBackend()), {}, table):
        out = packed_matmul(x, layers[1].packed_key, 16)
    assert out.shape == (5, 16) and torch.equal(out, layers[1].project(x))


def test_the_kernel_matmul_is_plain_matmul():
    x, weight = torch.randn(4, 24), torch.randn(8, 24)
    for first in (1, 3):
        out = kernel_matmul(x, weight, first)
        assert out.is_contiguous() and torch.equal(out, plain_matmul(x, weight))


def test_outside_a_compiled_pass_the_operators_refuse():
    q = torch.zeros(1, 2, 4)
    with pytest.raises(RuntimeError, match="compiled_pass"):
        paged_attention(q, q[:, :1], q[:, :1], 0, 4)
    with pytest.raises(RuntimeError, match="compiled_pass"):
        packed_matmul(torch.zeros(1, 4), 0, 4)
