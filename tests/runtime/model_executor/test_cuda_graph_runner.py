"""CudaGraphDecodeRunner's refusals, which run without a GPU: it captures only on a CUDA
device and only over a backend that declares ``supports_cuda_graph`` (capture itself is
checked on a GPU, tests/kernels/attention/test_backend_selection.py)."""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels.attention.torch_native_backend import TorchNativeAttentionBackend
from radixlm.models.layers.attention import PagedAttention
from radixlm.runtime.model_executor.cuda_graph_runner import CudaGraphDecodeRunner


def make_runner(device: str) -> CudaGraphDecodeRunner:
    return CudaGraphDecodeRunner(
        lambda *args: None, TorchNativeAttentionBackend(), None, torch.zeros(1, 8),
        PagedAttention(0, 4, 2, 16, 0.25), device=torch.device(device), max_batch_size=4,
        max_context_len=8,
    )


def test_graphs_are_refused_off_cuda():
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        make_runner("cpu")


def test_graphs_are_refused_on_a_backend_without_them_before_anything_is_allocated():
    with pytest.raises(ValueError, match="not TorchNativeAttentionBackend"):
        make_runner("cuda")  # no CUDA needed: the backend is asked first
