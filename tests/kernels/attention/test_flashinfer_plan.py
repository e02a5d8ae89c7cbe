"""The FlashInfer backend's plans against a stand-in FlashInfer that refuses what the real
one refuses (``flashinfer_standin``): the plan's host arrays are built on the host, the page
list on the device, nothing is read back from the device, the captured batch sizes share
their index buffers and the workspace starts zeroed.

"Nothing is read back" is checked on the ``meta`` device: its tensors hold no values, so
any ``.item()``, ``.tolist()``, ``int()``, ``.cpu()`` or boolean-mask gather on the
batch's device tensors raises, as a device-to-host copy would wait on a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from flashinfer_standin import Refused, standin_flashinfer
from paged_cases import random_paged_batch

from radixlm.kernels.attention.attention_backend import DecodeGraphSpec
from radixlm.kernels.attention.flashinfer_backend import (
    AttentionShape,
    FlashInferAttentionBackend,
)
from radixlm.kernels.forward_batch import ForwardBatch, ForwardMode
from radixlm.kv_cache.memory_pool import MHATokenToKVPool
from radixlm.models.layers.attention import PagedAttention

E, D = ForwardMode.EXTEND, ForwardMode.DECODE
PAGE = 4
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
SCALE = HEAD_DIM**-0.5
META, CPU = torch.device("meta"), torch.device("cpu")


def make_backend(device: torch.device, dtype=torch.bfloat16) -> FlashInferAttentionBackend:
    shape = AttentionShape(HEADS, KV_HEADS, HEAD_DIM, PAGE, dtype, SCALE)
    return FlashInferAttentionBackend(shape, device, flashinfer=standin_flashinfer())


def batch_on(device: torch.device, mode: ForwardMode, prefix_lens: list[int],
             extend_lens: list[int]) -> ForwardBatch:
    """A batch whose device tensors are on ``device`` and whose host lengths are lists."""
    batch = random_paged_batch(mode, prefix_lens, extend_lens, HEADS, KV_HEADS, HEAD_DIM,
                               PAGE, seed=5).batch
    moved = {f.name: getattr(batch, f.name).to(device) for f in dataclasses.fields(batch)
             if isinstance(getattr(batch, f.name), torch.Tensor)}
    return dataclasses.replace(batch, **moved)


def expected_tables(seq_lens: list[int], new_lens: list[int], window: int | None):
    first = [0 if window is None else max(n - e + 1 - window, 0) // PAGE
             for n, e in zip(seq_lens, new_lens)]
    pages = [-(-n // PAGE) - f for n, f in zip(seq_lens, first)]
    indptr = [sum(pages[:b]) for b in range(len(pages) + 1)]
    qo = [sum(new_lens[:b]) for b in range(len(new_lens) + 1)]
    return indptr, [(n - 1) % PAGE + 1 for n in seq_lens], qo


def check_host_plan(plan: dict, batch: ForwardBatch, window: int | None) -> None:
    indptr, last, qo = expected_tables(batch.seq_lens_list, batch.extend_seq_lens_list, window)
    assert plan["indptr"].tolist() == indptr and plan["last_page_len"].tolist() == last
    assert plan["indices"].device == batch.seq_lens.device and len(plan["indices"]) == indptr[-1]
    if "qo_indptr" in plan:
        assert plan["qo_indptr"].tolist() == qo
    assert plan["window_left"] == (-1 if window is None else window - 1)


@pytest.mark.parametrize("mode, prefix_lens, extend_lens", [
    (D, [0, 5, 16, 40], [1, 1, 1, 1]),
    (E, [0, 21, 6], [13, 5, 2]),
], ids=["decode", "extend"])
def test_plans_build_their_host_arrays_without_reading_the_device(
        mode, prefix_lens, extend_lens):
    backend = make_backend(META)
    batch = batch_on(META, mode, prefix_lens, extend_lens)
    backend.init_forward_metadata(batch)
    windowed = backend._wrapper_for((6, 2.0, None))  # a second kind, planned on first use
    check_host_plan(backend._active.plans[-1], batch, None)
    check_host_plan(windowed.plans[-1], batch, 6)


@pytest.mark.parametrize("mode, prefix_lens, extend_lens", [
    (D, [7, 30], [1, 1]),
    (E, [0, 9], [6, 3]),
], ids=["decode", "extend"])
def test_a_whole_step_over_two_kinds_of_layer_reads_nothing_back(
        mode, prefix_lens, extend_lens):
    """Plan, store K/V and run, layer after layer, with the pool on ``meta`` too."""
    backend = make_backend(META)
    batch = batch_on(META, mode, prefix_lens, extend_lens)
    slots = batch.req_to_token.shape[1]
    batch.kv_pool = MHATokenToKVPool(slots, 2, KV_HEADS, HEAD_DIM, torch.bfloat16, "meta")
    tokens = sum(extend_lens)
    q = torch.empty(tokens, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=META)
    k = torch.empty(tokens, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=META)
    backend.init_forward_metadata(batch)
    for layer_id, window in ((0, None), (1, 5)):
        layer = PagedAttention(layer_id, HEADS, KV_HEADS, HEAD_DIM, SCALE,
                               sliding_window=window)
        out = backend.forward(q, k, k, layer, batch)
        assert out.shape == q.shape and out.device == META
    assert len(backend._planned) == 2
    assert all(len(w.runs) == 1 and len(w.plans) == 1 for w in backend._planned.values())


def test_a_slot_mapped_kind_is_planned_without_reading_the_device():
    backend = make_backend(META)
    batch = batch_on(META, D, [9, 30], [1, 1])
    slot_map = torch.zeros(batch.req_to_token.shape[1] * 4, dtype=torch.int64, device=META)
    backend.init_forward_metadata(batch)
    check_host_plan(backend._wrapper_for((9, None, slot_map)).plans[-1], batch, 9)


def test_a_captured_decode_is_planned_without_reading_the_device():
    backend = make_backend(META)
    batch = batch_on(META, D, [3, 17, 0, 8], [1, 1, 1, 1])
    layer = PagedAttention(0, HEADS, KV_HEADS, HEAD_DIM, SCALE)
    backend.prepare_decode_graphs(DecodeGraphSpec((1, 2, 4), 64, layer, None, META))
    backend.init_decode_graph_metadata(batch)
    wrapper = backend._graph_states[4].wrapper
    assert wrapper.use_cuda_graph and wrapper is backend._active
    check_host_plan(wrapper.plans[-1], batch, None)


def test_consecutive_batches_plan_from_different_host_memory():
    """A batch's host arrays may still be in flight to the device while the next batch
    plans: the next one's arrays lie elsewhere, and the one after may reuse them."""
    backend = make_backend(META)
    pointers = []
    for prefix in ([4], [9], [13]):
        backend.init_forward_metadata(batch_on(META, D, prefix, [1]))
        pointers.append(backend._active.plans[-1]["indptr"].untyped_storage().data_ptr())
    assert pointers[0] != pointers[1] and pointers[2] == pointers[0]


def test_kinds_met_before_are_planned_before_the_batch_runs():
    """So that a batch's copies of its host arrays are queued ahead of its kernels."""
    backend = make_backend(META)
    backend.init_forward_metadata(batch_on(META, D, [4, 11], [1, 1]))
    windowed = backend._wrapper_for((5, None, None))
    backend.init_forward_metadata(batch_on(META, D, [5, 12], [1, 1]))
    assert len(windowed.plans) == 2 and len(backend._planned) == 2


def test_captured_batch_sizes_share_one_page_index_buffer_per_kind():
    backend = make_backend(CPU)
    sizes, max_context = (1, 2, 4, 8, 16), 64
    layer = PagedAttention(0, HEADS, KV_HEADS, HEAD_DIM, SCALE)
    backend.prepare_decode_graphs(DecodeGraphSpec(sizes, max_context, layer, None, CPU))
    backend.init_decode_graph_metadata(batch_on(CPU, D, [3, 17], [1, 1]))
    backend._wrapper_for((5, None, None))  # a windowed kind met in a graph warm-up

    def storages(key_filter):
        return {w.indices_buffer.untyped_storage().data_ptr()
                for state in backend._graph_states.values()
                for key, w in state.by_kind.items() if key_filter(key)}

    assert len(storages(lambda key: key[0] is None)) == 1
    assert len(storages(lambda key: key[0] == 5)) == 1
    plain = backend._graph_states[16].wrapper.indices_buffer
    assert len(plain) == sizes[-1] * max_context // PAGE


@pytest.fixture
def visible_uninitialized_memory():
    """``torch.empty`` fills its memory with 0xFF in deterministic mode."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def test_the_workspace_is_zeroed_before_its_first_use(visible_uninitialized_memory):
    backend = make_backend(CPU)
    assert not backend.workspace.any()


def test_the_standin_refuses_what_flashinfer_refuses():
    """The stand-in is not a yes-man: float32, an unsupported head size, device-side index
    arrays and a dirty workspace are refused."""
    with pytest.raises(Refused, match="kernels for"):
        make_backend(META, torch.float32).init_forward_metadata(batch_on(META, D, [3], [1]))
    backend = make_backend(META)
    backend.shape.head_dim = 80
    with pytest.raises(Refused, match="head_dim 80"):
        backend.init_forward_metadata(batch_on(META, D, [3], [1]))
    decode = standin_flashinfer().BatchDecodeWithPagedKVCacheWrapper(
        torch.zeros(16, dtype=torch.uint8, device=META))
    table = torch.tensor([0, 1], dtype=torch.int32)
    pages, last = torch.zeros(1, dtype=torch.int32, device=META), table[1:]
    with pytest.raises(Refused, match="indptr must be on the host"):
        decode.plan(table.to(META), pages, last, HEADS, KV_HEADS, HEAD_DIM, PAGE,
                    q_data_type=torch.bfloat16)
    with pytest.raises(Refused, match="must be zeroed"):
        standin_flashinfer().BatchDecodeWithPagedKVCacheWrapper(
            torch.ones(16, dtype=torch.uint8))
