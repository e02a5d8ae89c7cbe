"""The FlashInfer backend's windows, soft-caps and slot maps, without a GPU: a stand-in
``flashinfer`` whose wrappers attend exactly as FlashInfer documents its plans (each
request's keys are the pages listed for it, the causal mask and ``window_left`` aligned to
the end of the keys, ``logits_soft_cap`` c giving c * tanh(q k * sm_scale / c)), checked
against the float64 reference of ``windowed_cases``. What runs on a GPU is FlashInfer's own;
this checks the tables and plan options the backend hands it."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from windowed_cases import (
    HEAD_DIM,
    KV_HEADS,
    MAPPED_LAYER,
    map_pool,
    prefix_kv,
    reference,
    windowed_case,
)

from radixlm.kernels.attention.attention_backend import DecodeGraphSpec
from radixlm.kernels.attention.flashinfer_backend import (
    AttentionShape,
    FlashInferAttentionBackend,
    paged_kv_table,
)
from radixlm.kernels.forward_batch import ForwardMode
from radixlm.models.layers.attention import PagedAttention

E, D = ForwardMode.EXTEND, ForwardMode.DECODE
PAGE = 4
HEADS = KV_HEADS * 2
SCALE = HEAD_DIM**-0.5


class AttendingWrapper:
    """A FlashInfer paged wrapper's contract in float64: ``plan`` keeps the tables and
    options, ``run`` attends each request's queries over its listed pages."""

    def __init__(self, workspace, layout, **options):
        self.options = options
        self.plans: list[tuple[tuple, dict]] = []

    def plan(self, *args, **kwargs):
        self.plans.append((args, kwargs))

    def run(self, q, paged):
        args, kw = self.plans[-1]
        decode = "causal" not in kw
        qo_indptr = torch.arange(len(q) + 1) if decode else args[0]
        indptr, indices, last = args[0 + (not decode): 3 + (not decode)]
        k_pages, v_pages = paged
        group = q.shape[1] // k_pages.shape[2]
        out = torch.empty(q.shape, dtype=torch.float64)
        for b in range(len(indptr) - 1):
            pages = indices[indptr[b]: indptr[b + 1]].long()
            n = (len(pages) - 1) * PAGE + int(last[b])
            keys = k_pages[pages].flatten(0, 1)[:n].double()  # (n, H_kv, D)
            values = v_pages[pages].flatten(0, 1)[:n].double()
            rows = range(int(qo_indptr[b]), int(qo_indptr[b + 1]))
            for i, t in enumerate(rows):
                pos = n - len(rows) + i
                lo = 0 if kw["window_left"] < 0 else max(0, pos - kw["window_left"])
                for h in range(q.shape[1]):
                    s = keys[lo: pos + 1, h // group] @ q[t, h].double() * kw["sm_scale"]
                    if kw["logits_soft_cap"] is not None:
                        cap = kw["logits_soft_cap"]
                        s = cap * torch.tanh(s / cap)
                    out[t, h] = torch.softmax(s, 0) @ values[lo: pos + 1, h // group]
        return out


@pytest.fixture
def backend(monkeypatch):
    fake = types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=AttendingWrapper,
                                 BatchDecodeWithPagedKVCacheWrapper=AttendingWrapper)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    shape = AttentionShape(HEADS, KV_HEADS, HEAD_DIM, PAGE, torch.float32, SCALE)
    return FlashInferAttentionBackend(shape, torch.device("cpu"))


def run(backend, case, layer):
    batch = case.batch
    batch.attn_backend = backend
    backend.init_forward_metadata(batch)
    return backend.forward(case.q, case.k, case.v, layer, batch)


@pytest.mark.parametrize("mapped", [False, True], ids=["slots", "slot_map"])
@pytest.mark.parametrize("mode, prefix_lens, extend_lens, window, softcap", [
    (E, [0, 21, 6], [13, 5, 2], 6, None),
    (E, [9, 0], [3, 7], 1, 2.0),
    (E, [14], [3], None, 2.0),
    (D, [30, 2, 11, 17], [1, 1, 1, 1], 9, 3.0),
    (D, [30, 5], [1, 1], 100, None),
])
def test_flashinfer_plans_windows_softcaps_and_maps_that_attend_right(
        backend, mode, prefix_lens, extend_lens, window, softcap, mapped):
    case = windowed_case(mode, prefix_lens, extend_lens, HEADS, page_size=PAGE, seed=9)
    layer_id = 0
    if mapped:
        map_pool(case, window, seed=1, page=PAGE)
        layer_id = MAPPED_LAYER
    layer = PagedAttention(layer_id, HEADS, KV_HEADS, HEAD_DIM, SCALE, sliding_window=window,
                           logit_softcap=softcap)
    expected = reference(case, prefix_kv(case, layer_id), SCALE, window, softcap)
    out = run(backend, case, layer)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_a_window_leaves_out_the_pages_before_it():
    case = windowed_case(D, [30, 2], [1, 1], HEADS, page_size=PAGE)
    indptr, indices, last = paged_kv_table(case.batch, PAGE, window=9)
    # 31 keys, the last 9 (22..30): pages 5..7; 3 keys: page 0 alone.
    assert indptr.tolist() == [0, 3, 4] and last.tolist() == [3, 3]
    row = int(case.batch.req_pool_indices[0])
    assert indices[:3].tolist() == (case.batch.req_to_token[row, 20:31:4] // PAGE).tolist()


def test_a_slot_map_on_another_device_is_refused():
    case = windowed_case(D, [5], [1], HEADS, page_size=PAGE)
    with pytest.raises(ValueError, match="the slot map is on meta"):
        paged_kv_table(case.batch, PAGE, slot_map=torch.empty(64, dtype=torch.int64,
                                                                device="meta"))


def test_each_kind_of_layer_is_planned_once_a_batch(backend):
    case = windowed_case(E, [5, 0], [3, 6], HEADS, page_size=PAGE)
    kinds = [(None, None), (4, None), (4, 2.0), (4, None), (None, None), (4, 2.0)]
    for window, softcap in kinds:
        layer = PagedAttention(0, HEADS, KV_HEADS, HEAD_DIM, SCALE, sliding_window=window,
                               logit_softcap=softcap)
        if window is None and softcap is None and backend._batch is None:
            run(backend, case, layer)
        else:
            backend.forward(case.q, case.k, case.v, layer, case.batch)
    planned = backend._planned
    assert len(planned) == 3 and all(len(w.plans) == 1 for w in planned.values())
    options = sorted((kw["window_left"], str(kw["logits_soft_cap"]))
                     for w in planned.values() for _, kw in w.plans)
    assert options == [(-1, "None"), (3, "2.0"), (3, "None")]


def test_graph_states_plan_every_kind_met_before(backend):
    case = windowed_case(D, [9, 20], [1, 1], HEADS, page_size=PAGE)
    windowed = PagedAttention(0, HEADS, KV_HEADS, HEAD_DIM, SCALE, sliding_window=5,
                              logit_softcap=2.0)
    run(backend, case, windowed)  # an eager batch meets the windowed kind
    plain = PagedAttention(0, HEADS, KV_HEADS, HEAD_DIM, SCALE)
    backend.prepare_decode_graphs(DecodeGraphSpec((2,), 64, plain, case.batch.kv_pool,
                                                  torch.device("cpu")))
    backend.init_decode_graph_metadata(case.batch)
    state = backend._graph_states[2]
    assert len(state.by_kind) == 2
    assert all(w.options["use_cuda_graph"] for w in state.by_kind.values())
    expected = reference(case, prefix_kv(case, 0), SCALE, 5, 2.0)
    out = backend.forward(case.q, case.k, case.v, windowed, case.batch)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_a_kind_first_met_in_a_graph_warm_up_is_planned_on_the_graph_wrappers(backend):
    """The graph runner's warm-up runs the model after ``init_decode_graph_metadata`` and
    before capturing: a windowed layer met there gets a fixed-buffer wrapper of the batch
    size's state, planned for the padded batch, which the capture then uses."""
    case = windowed_case(D, [9, 20], [1, 1], HEADS, page_size=PAGE)
    windowed = PagedAttention(0, HEADS, KV_HEADS, HEAD_DIM, SCALE, sliding_window=3)
    backend.prepare_decode_graphs(DecodeGraphSpec((2,), 64, windowed, case.batch.kv_pool,
                                                  torch.device("cpu")))
    case.batch.attn_backend = backend
    backend.init_decode_graph_metadata(case.batch)
    state = backend._graph_states[2]
    assert len(state.by_kind) == 1
    expected = reference(case, prefix_kv(case, 0), SCALE, 3, None)
    out = backend.forward(case.q, case.k, case.v, windowed, case.batch)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert len(state.by_kind) == 2
    assert all(w.options["use_cuda_graph"] for w in state.by_kind.values())
