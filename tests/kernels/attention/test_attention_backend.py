"""The AttentionBackend contract's parts that callers program against: the layer protocol,
the declared capabilities, and the CUDA-graph hooks, checked where they run without a GPU
(the Triton backend under the interpreter, FlashInfer's planning against a stand-in
``flashinfer`` module that records what it is asked)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from kernel_device import KERNEL_DEVICE
from paged_cases import clone_pool, random_paged_batch

from radixlm.kernels.attention import triton_backend
from radixlm.kernels.attention.attention_backend import AttentionBackend, DecodeGraphSpec
from radixlm.kernels.attention.attention_layer import AttentionLayer
from radixlm.kernels.attention.flashinfer_backend import (
    AttentionShape,
    FlashInferAttentionBackend,
    paged_kv_table,
)
from radixlm.kernels.attention.torch_native_backend import TorchNativeAttentionBackend
from radixlm.kernels.attention.triton_backend import TritonAttentionBackend
from radixlm.kernels.forward_batch import ForwardMode
from radixlm.kv_cache.memory_pool import MLATokenToKVPool
from radixlm.models.layers.attention import PagedAttention

CPU = torch.device("cpu")
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 16


def test_the_models_attention_layer_is_what_backends_read():
    layer = PagedAttention(3, HEADS, KV_HEADS, HEAD_DIM, 0.25)
    assert isinstance(layer, AttentionLayer)
    assert layer.v_head_dim == HEAD_DIM
    latent = PagedAttention(0, 16, 1, 576, 0.1, v_head_dim=512)
    assert isinstance(latent, AttentionLayer) and latent.v_head_dim == 512
    assert not isinstance(object(), AttentionLayer)


@pytest.mark.parametrize(
    ("backend_class", "graphs", "kernels"),
    [
        (TorchNativeAttentionBackend, False, False),
        (TritonAttentionBackend, True, True),
        (FlashInferAttentionBackend, True, True),
    ],
)
def test_each_backend_declares_its_capabilities(backend_class, graphs, kernels):
    assert issubclass(backend_class, AttentionBackend)
    assert backend_class.supports_cuda_graph is graphs
    assert backend_class.uses_custom_kernels is kernels


def test_a_backend_without_graphs_refuses_the_graph_hooks():
    backend = TorchNativeAttentionBackend()
    case = random_paged_batch(ForwardMode.DECODE, [4], [1], HEADS, KV_HEADS, HEAD_DIM, 1, 0)
    spec = DecodeGraphSpec(
        (1,), 32, PagedAttention(0, HEADS, KV_HEADS, HEAD_DIM, 0.25), case.batch.kv_pool, CPU
    )
    with pytest.raises(NotImplementedError, match="TorchNativeAttentionBackend does not"):
        backend.prepare_decode_graphs(spec)
    with pytest.raises(NotImplementedError, match="does not support CUDA graphs"):
        backend.init_decode_graph_metadata(case.batch)


# ---- Triton: decode scratch pinned for the largest captured batch ------------------------------


@pytest.mark.triton
def test_triton_graph_decode_runs_on_the_pinned_scratch(monkeypatch):
    """After ``prepare_decode_graphs`` a decode of any captured size allocates nothing and
    matches the torch-native backend."""
    layer = PagedAttention(1, HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    case = random_paged_batch(
        ForwardMode.DECODE, [0, 9, 30], [1, 1, 1], HEADS, KV_HEADS, HEAD_DIM, 1, seed=7,
        device=KERNEL_DEVICE,
    )
    batch = case.batch
    reference_pool = clone_pool(batch.kv_pool)
    backend = TritonAttentionBackend()
    backend.prepare_decode_graphs(
        DecodeGraphSpec((1, 2, 4), 96, layer, batch.kv_pool, KERNEL_DEVICE))
    pinned = backend._reserved_scratch
    assert pinned[0].shape == (4, HEADS, backend.config.num_kv_splits, HEAD_DIM)

    def no_allocation(*args):
        raise AssertionError("a graph decode allocated scratch")

    monkeypatch.setattr(triton_backend, "decode_scratch", no_allocation)
    batch.attn_backend = backend
    backend.init_decode_graph_metadata(batch)
    out = backend.forward(case.q, case.k, case.v, layer, batch)

    batch.kv_pool, batch.attn_backend = reference_pool, TorchNativeAttentionBackend()
    batch.attn_backend.init_forward_metadata(batch)
    expected = batch.attn_backend.forward(case.q, case.k, case.v, layer, batch)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    assert backend._reserved_scratch is pinned


def test_triton_graph_scratch_has_the_latent_pools_value_width():
    pool = MLATokenToKVPool(16, 1, kv_lora_rank=32, qk_rope_head_dim=8, dtype=torch.float32,
                            device=CPU)
    layer = PagedAttention(0, 4, 1, 40, 0.1, v_head_dim=32)
    backend = TritonAttentionBackend()
    backend.prepare_decode_graphs(DecodeGraphSpec((1, 2, 3), 64, layer, pool, CPU))
    assert backend._reserved_scratch[0].shape == (3, 4, backend.config.num_kv_splits, 32)


# ---- FlashInfer: one planned wrapper per captured batch size -----------------------------------


class RecordingWrapper:
    """Stands in for a FlashInfer wrapper: keeps its constructor options and every plan."""

    def __init__(self, workspace, layout, **options):
        self.options = options
        self.plans: list[tuple] = []

    def plan(self, *args, **kwargs):
        self.plans.append(args)


@pytest.fixture
def flashinfer_backend(monkeypatch):
    fake = types.SimpleNamespace(
        BatchPrefillWithPagedKVCacheWrapper=RecordingWrapper,
        BatchDecodeWithPagedKVCacheWrapper=RecordingWrapper,
    )
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    shape = AttentionShape(HEADS, KV_HEADS, HEAD_DIM, 4, torch.float32, 0.25)
    return FlashInferAttentionBackend(shape, CPU)


def test_flashinfer_prepares_a_fixed_buffer_wrapper_per_captured_size(flashinfer_backend):
    backend = flashinfer_backend
    case = random_paged_batch(ForwardMode.DECODE, [3], [1], HEADS, KV_HEADS, HEAD_DIM, 4, 0)
    layer = PagedAttention(0, HEADS, KV_HEADS, HEAD_DIM, 0.25)
    backend.prepare_decode_graphs(DecodeGraphSpec((1, 2, 4), 37, layer, case.batch.kv_pool, CPU))
    assert sorted(backend._graph_states) == [1, 2, 4]
    for size, state in backend._graph_states.items():
        options = state.wrapper.options
        assert options["use_cuda_graph"] is True
        assert options["paged_kv_indptr_buffer"].shape == (size + 1,)
        assert options["paged_kv_last_page_len_buffer"].shape == (size,)
        # ceil(37 / 4) = 10 pages for each of the largest batch's 4 requests
        assert options["paged_kv_indices_buffer"].shape == (40,)


def test_flashinfer_graph_metadata_plans_the_wrapper_of_the_batch_size(flashinfer_backend):
    backend = flashinfer_backend
    case = random_paged_batch(
        ForwardMode.DECODE, [0, 5, 16, 30], [1, 1, 1, 1], HEADS, KV_HEADS, HEAD_DIM, 4, seed=2
    )
    batch, layer = case.batch, PagedAttention(0, HEADS, KV_HEADS, HEAD_DIM, 0.25)
    backend.prepare_decode_graphs(DecodeGraphSpec((2, 4), 96, layer, batch.kv_pool, CPU))
    backend.init_decode_graph_metadata(batch)
    wrapper = backend._graph_states[4].wrapper
    assert backend._active is wrapper and backend._graph_states[2].wrapper.plans == []
    (planned,) = wrapper.plans
    for got, expected in zip(planned[:3], paged_kv_table(batch, 4)):
        assert torch.equal(got, expected)

    three = random_paged_batch(ForwardMode.DECODE, [1, 2, 3], [1, 1, 1], HEADS, KV_HEADS,
                               HEAD_DIM, 4, seed=3)
    with pytest.raises(ValueError, match=r"batch size 3; prepared sizes: \[2, 4\]"):
        backend.init_decode_graph_metadata(three.batch)
