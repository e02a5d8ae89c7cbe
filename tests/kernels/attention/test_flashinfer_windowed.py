"""The FlashInfer backend's windows, soft-caps and slot maps, without a GPU: the shared
stand-in ``flashinfer`` (``flashinfer_standin``), which refuses what FlashInfer refuses and
attends exactly as FlashInfer documents its plans, checked against the float64 reference of
``windowed_cases``, in bfloat16 with 64-wide heads (a dtype and head size FlashInfer has
kernels for). What runs on a GPU is FlashInfer's own; this checks the tables and plan
options the backend hands it."""

from __future__ import annotations

import pytest
import torch
from flashinfer_standin import standin_flashinfer
from windowed_cases import (
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
HEAD_DIM = 64
DTYPE = torch.bfloat16
SCALE = HEAD_DIM**-0.5
TOLERANCE = dict(atol=1e-2, rtol=1e-2)  # bfloat16 outputs against a float64 reference


@pytest.fixture
def backend():
    shape = AttentionShape(HEADS, KV_HEADS, HEAD_DIM, PAGE, DTYPE, SCALE)
    return FlashInferAttentionBackend(shape, torch.device("cpu"),
                                      flashinfer=standin_flashinfer())


def case_of(mode, prefix_lens, extend_lens, seed=3):
    return windowed_case(mode, prefix_lens, extend_lens, HEADS, page_size=PAGE, seed=seed,
                         dtype=DTYPE, head_dim=HEAD_DIM)


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
    case = case_of(mode, prefix_lens, extend_lens, seed=9)
    layer_id = 0
    if mapped:
        map_pool(case, window, seed=1, page=PAGE)
        layer_id = MAPPED_LAYER
    layer = PagedAttention(layer_id, HEADS, KV_HEADS, HEAD_DIM, SCALE, sliding_window=window,
                           logit_softcap=softcap)
    expected = reference(case, prefix_kv(case, layer_id), SCALE, window, softcap)
    out = run(backend, case, layer)
    assert out.dtype == DTYPE
    torch.testing.assert_close(out.double(), expected, **TOLERANCE)


def test_a_window_leaves_out_the_pages_before_it():
    case = case_of(D, [30, 2], [1, 1])
    indptr, indices, last = paged_kv_table(case.batch, PAGE, window=9)
    # 31 keys, the last 9 (22..30): pages 5..7; 3 keys: page 0 alone.
    assert indptr.tolist() == [0, 3, 4] and last.tolist() == [3, 3]
    row = int(case.batch.req_pool_indices[0])
    assert indices[:3].tolist() == (case.batch.req_to_token[row, 20:31:4] // PAGE).tolist()


def test_a_slot_map_on_another_device_is_refused():
    case = case_of(D, [5], [1])
    with pytest.raises(ValueError, match="the slot map is on meta"):
        paged_kv_table(case.batch, PAGE, slot_map=torch.empty(64, dtype=torch.int64,
                                                                device="meta"))


def test_each_kind_of_layer_is_planned_once_a_batch(backend):
    case = case_of(E, [5, 0], [3, 6])
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
    options = sorted((plan["window_left"], str(plan["logits_soft_cap"]))
                     for w in planned.values() for plan in w.plans)
    assert options == [(-1, "None"), (3, "2.0"), (3, "None")]


def test_graph_states_plan_every_kind_met_before(backend):
    case = case_of(D, [9, 20], [1, 1])
    windowed = PagedAttention(0, HEADS, KV_HEADS, HEAD_DIM, SCALE, sliding_window=5,
                              logit_softcap=2.0)
    run(backend, case, windowed)  # an eager batch meets the windowed kind
    plain = PagedAttention(0, HEADS, KV_HEADS, HEAD_DIM, SCALE)
    backend.prepare_decode_graphs(DecodeGraphSpec((2,), 64, plain, case.batch.kv_pool,
                                                  torch.device("cpu")))
    backend.init_decode_graph_metadata(case.batch)
    state = backend._graph_states[2]
    assert len(state.by_kind) == 2
    assert all(w.use_cuda_graph for w in state.by_kind.values())
    expected = reference(case, prefix_kv(case, 0), SCALE, 5, 2.0)
    out = backend.forward(case.q, case.k, case.v, windowed, case.batch)
    torch.testing.assert_close(out.double(), expected, **TOLERANCE)


def test_a_kind_first_met_in_a_graph_warm_up_is_planned_on_the_graph_wrappers(backend):
    """The graph runner's warm-up runs the model after ``init_decode_graph_metadata`` and
    before capturing: a windowed layer met there gets a fixed-buffer wrapper of the batch
    size's state, planned for the padded batch, which the capture then uses."""
    case = case_of(D, [9, 20], [1, 1])
    windowed = PagedAttention(0, HEADS, KV_HEADS, HEAD_DIM, SCALE, sliding_window=3)
    backend.prepare_decode_graphs(DecodeGraphSpec((2,), 64, windowed, case.batch.kv_pool,
                                                  torch.device("cpu")))
    case.batch.attn_backend = backend
    backend.init_decode_graph_metadata(case.batch)
    state = backend._graph_states[2]
    assert len(state.by_kind) == 1
    expected = reference(case, prefix_kv(case, 0), SCALE, 3, None)
    out = backend.forward(case.q, case.k, case.v, windowed, case.batch)
    torch.testing.assert_close(out.double(), expected, **TOLERANCE)
    assert len(state.by_kind) == 2
    assert all(w.use_cuda_graph for w in state.by_kind.values())
