"""Attention backend selection: ``auto`` per device, dtype and head size (FlashInfer only
where it has kernels: 16-bit, head sizes 64/128/256), explicit names refused with the reason;
and the pieces of the GPU backends that run without a GPU (FlashInfer's page table, the
CUDA-graph batch sizes)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from paged_cases import random_paged_batch

from radixlm.kernels.attention.backend_selection import (
    BackendRequest,
    HostSupport,
    create_backend,
    resolve_backend_name,
    select_backend,
)
from radixlm.kernels.attention.flashinfer_backend import paged_kv_table
from radixlm.kernels.attention.torch_native_backend import TorchNativeAttentionBackend
from radixlm.kernels.forward_batch import ForwardMode
from radixlm.runtime.model_executor.cuda_graph_runner import capture_batch_sizes, padded_batch_size
from radixlm.runtime.server_args import ServerArgs

CPU = torch.device("cpu")
GPU = torch.device("cuda")
F32 = torch.float32
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks CPU behaviour")


@needs_no_cuda
def test_auto_is_torch_native_on_cpus():
    assert resolve_backend_name(BackendRequest("auto", CPU, F32, 64)) == "torch_native"
    backend = create_backend(
        "torch_native", CPU, num_heads=4, num_kv_heads=2, head_dim=16, page_size=1,
        dtype=torch.float32, scaling=0.25,
    )
    assert isinstance(backend, TorchNativeAttentionBackend)


@needs_no_cuda
def test_flashinfer_on_a_cpu_is_refused_naming_cuda():
    with pytest.raises(ValueError, match="attention_backend='flashinfer' cannot run here: "
                       "FlashInfer needs a CUDA device"):
        resolve_backend_name(BackendRequest("flashinfer", CPU, F32, 64))


@needs_no_cuda
@pytest.mark.triton
def test_triton_runs_on_a_cpu_under_the_interpreter():
    assert os.environ.get("TRITON_INTERPRET") == "1"  # set by conftest
    assert resolve_backend_name(BackendRequest("triton", CPU, F32, 64)) == "triton"


@needs_no_cuda
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_triton_without_the_interpreter_is_refused_with_the_fix():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = (
        "import torch\n"
        "from radixlm.kernels.attention.backend_selection import (\n"
        "    BackendRequest, resolve_backend_name)\n"
        "try:\n"
        "    resolve_backend_name(BackendRequest(\n"
        "        'triton', torch.device('cpu'), torch.float32, 64))\n"
        "except ValueError as err:\n"
        "    print(err)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert "attention_backend='triton' cannot run here" in done.stdout, done.stderr[-2000:]
    assert "TRITON_INTERPRET=1" in done.stdout


def test_unknown_backend_names_are_refused_where_they_enter():
    with pytest.raises(ValueError, match="attention_backend must be"):
        BackendRequest("cudnn", CPU, F32, 64)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        ServerArgs(attention_backend="cudnn")


GPU_WITH_EVERYTHING = HostSupport(cuda_available=True, flashinfer_installed=True,
                                  triton_reason=None)
GPU_WITHOUT_FLASHINFER = HostSupport(cuda_available=True, flashinfer_installed=False,
                                     triton_reason=None)


@pytest.mark.parametrize(("dtype", "head_dim", "chosen"), [
    (torch.bfloat16, 128, "flashinfer"),
    (torch.float16, 64, "flashinfer"),
    (torch.bfloat16, 256, "flashinfer"),
    (torch.float32, 128, "triton"),  # FlashInfer has no float32 kernels
    (torch.bfloat16, 96, "triton"),  # nor kernels for this head size
    (torch.bfloat16, 16, "triton"),
])
def test_auto_on_cuda_picks_flashinfer_only_where_it_has_kernels(dtype, head_dim, chosen):
    choice = select_backend(BackendRequest("auto", GPU, dtype, head_dim), GPU_WITH_EVERYTHING)
    assert choice.name == chosen


def test_auto_says_why_flashinfer_was_passed_over():
    float32 = select_backend(BackendRequest("auto", GPU, F32, 128), GPU_WITH_EVERYTHING)
    assert "no float32 kernels" in float32.reason
    odd = select_backend(BackendRequest("auto", GPU, torch.bfloat16, 96), GPU_WITH_EVERYTHING)
    assert "head size 96" in odd.reason
    missing = select_backend(BackendRequest("auto", GPU, torch.bfloat16, 128),
                             GPU_WITHOUT_FLASHINFER)
    assert (missing.name, "flashinfer package" in missing.reason) == ("triton", True)
    mla = select_backend(BackendRequest("auto", GPU, torch.bfloat16, 128, uses_mla=True),
                         GPU_WITH_EVERYTHING)
    assert (mla.name, "latent attention" in mla.reason) == ("triton", True)


def test_auto_on_cuda_without_triton_or_flashinfer_kernels_runs_torch():
    host = HostSupport(cuda_available=True, flashinfer_installed=True,
                       triton_reason="it needs the triton package")
    choice = select_backend(BackendRequest("auto", GPU, F32, 128), host)
    assert choice.name == "torch_native"
    assert "no float32 kernels" in choice.reason and "triton package" in choice.reason


@pytest.mark.parametrize(("dtype", "head_dim", "why"), [
    (torch.float32, 128, "FlashInfer has no float32 kernels"),
    (torch.bfloat16, 80, "FlashInfer has no kernels for head size 80"),
])
def test_flashinfer_asked_for_without_its_kernels_is_refused_naming_why(dtype, head_dim, why):
    request = BackendRequest("flashinfer", GPU, dtype, head_dim)
    with pytest.raises(ValueError, match=f"attention_backend='flashinfer' cannot run here: {why}"):
        select_backend(request, GPU_WITH_EVERYTHING)


def test_explicit_flashinfer_with_its_kernels_is_kept():
    request = BackendRequest("flashinfer", GPU, torch.bfloat16, 128)
    assert select_backend(request, GPU_WITH_EVERYTHING).name == "flashinfer"


@needs_no_cuda
def test_the_choice_and_its_reason_are_logged(caplog):
    with caplog.at_level("INFO", logger="radixlm.kernels.attention.backend_selection"):
        resolve_backend_name(BackendRequest("auto", CPU, F32, 64))
    assert "attention backend torch_native: the device is cpu, not CUDA" in caplog.text


def test_requests_without_a_head_size_are_refused_where_they_enter():
    with pytest.raises(ValueError, match="head_dim must be a positive integer"):
        BackendRequest("auto", CPU, F32, 0)


def test_server_args_take_the_kernel_backends_and_graph_options():
    args = ServerArgs(attention_backend="triton", disable_cuda_graph=True, cuda_graph_max_bs=8)
    assert (args.attention_backend, args.disable_cuda_graph, args.cuda_graph_max_bs) == (
        "triton", True, 8)
    with pytest.raises(ValueError, match="cuda_graph_max_bs must be a positive integer"):
        ServerArgs(cuda_graph_max_bs=0)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_flashinfer_page_table_lists_each_requests_pages_in_order(page_size):
    """indptr / indices / last_page_len rebuild exactly the slots of req_to_token."""
    case = random_paged_batch(
        ForwardMode.DECODE, [0, 5, 16, 40], [1, 1, 1, 1], 4, 2, 16, page_size, seed=page_size
    )
    fb = case.batch
    indptr, indices, last_page_len = paged_kv_table(fb, page_size)
    assert indptr.dtype == indices.dtype == last_page_len.dtype == torch.int32
    for b, (row, seq_len) in enumerate(zip(fb.req_pool_indices.tolist(), fb.seq_lens_list)):
        pages = indices[indptr[b] : indptr[b + 1]]
        slots = (pages[:, None] * page_size + torch.arange(page_size)).flatten()
        n = (len(pages) - 1) * page_size + int(last_page_len[b])
        assert n == seq_len
        assert torch.equal(slots[:n], fb.req_to_token[row, :seq_len].to(torch.int32))


def test_capture_sizes_cover_every_batch_up_to_the_largest():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(6) == [1, 2, 4, 6]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_batch_sizes(64)
    assert sizes[-1] == 64 and sizes == sorted(set(sizes))
    assert [padded_batch_size(b, sizes) for b in (1, 3, 5, 9, 64)] == [1, 4, 8, 16, 64]
    with pytest.raises(ValueError, match="exceeds the largest captured size 64"):
        padded_batch_size(65, sizes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_decode_matches_eager_decode(engine_for):
    """On a GPU: greedy tokens with captured decode graphs (batches padded to 1, 2, 4)
    equal those of eager decode on the same Triton kernels."""
    prompts = ["The quick brown fox", "a", "def add(a, b):"]
    params = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
    graphs = engine_for(attention_backend="triton", device="cuda", cuda_graph_max_bs=4)
    eager = engine_for(attention_backend="triton", device="cuda", disable_cuda_graph=True)
    assert graphs.get_server_info()["cuda_graph"] is True
    assert eager.get_server_info()["cuda_graph"] is False
    assert [o["output_ids"] for o in graphs.generate(prompts, params)] == [
        o["output_ids"] for o in eager.generate(prompts, params)
    ]
