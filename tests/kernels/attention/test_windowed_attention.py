"""Sliding windows, logit soft-capping and slot maps in the torch-native backend
(``windowed_attention.py``) against a float64 reference that computes each query's masked
softmax explicitly (``windowed_cases.reference``)."""

from __future__ import annotations

import types
from dataclasses import replace

import pytest
import torch
from fused_kernels import enable_or_skip
from windowed_cases import (
    HEAD_DIM,
    KV_HEADS,
    MAPPED_LAYER,
    map_pool,
    prefix_kv,
    reference,
    windowed_case,
)

from radixlm.kernels.attention import torch_native_backend, windowed_attention
from radixlm.kernels.attention.torch_native_backend import TorchNativeAttentionBackend
from radixlm.kernels.cpu_ops import fused_ops
from radixlm.kernels.forward_batch import ForwardMode
from radixlm.models.layers.attention import PagedAttention

E, D = ForwardMode.EXTEND, ForwardMode.DECODE
# name: (mode, prefix lengths, extend lengths, window)
CASES = {
    "fresh_prompt_longer_than_window": (E, [0], [20], 5),
    "extend_after_prefix_longer_than_window": (E, [30], [6], 8),
    "extend_after_prefix_shorter_than_window": (E, [3], [6], 16),
    "ragged_mixed_extend": (E, [0, 12, 5, 40], [9, 4, 1, 1], 6),
    "window_longer_than_sequences": (E, [7, 0], [5, 11], 200),
    "window_of_one": (E, [4, 0], [3, 6], 1),
    "long_prompt_beside_a_prefix": (E, [0, 50], [40, 2], 7),
    "decode_ragged": (D, [4, 40, 9, 0], [1, 1, 1, 1], 8),
    "decode_uniform": (D, [20, 20, 20], [1, 1, 1], 5),
    "decode_window_of_one": (D, [6, 13], [1, 1], 1),
    "decode_window_longer_than_context": (D, [6, 13], [1, 1], 64),
}


def attend(case, layer, backend=None):
    batch = case.batch
    batch.attn_backend = backend or TorchNativeAttentionBackend()
    batch.attn_backend.init_forward_metadata(batch)
    return batch.attn_backend.forward(case.q, case.k, case.v, layer, batch)


def check(case, layer, window, softcap, backend=None):
    """The backend's output matches the reference over the pool as it was, and the new K/V
    are stored where the layer's map (if any) puts them."""
    prefixes = prefix_kv(case, layer.layer_id)
    out = attend(case, layer, backend)
    expected = reference(case, prefixes, layer.scaling, window, softcap)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    pool, loc = case.batch.kv_pool, case.batch.out_cache_loc
    slot_map = pool.slot_map_for(layer.layer_id)
    loc = loc if slot_map is None else slot_map[loc]
    assert torch.equal(pool.k_buffers[layer.layer_id][loc], case.k)
    assert torch.equal(pool.v_buffers[layer.layer_id][loc], case.v)


@pytest.mark.parametrize("softcap", [None, 4.0], ids=["no_cap", "cap"])
@pytest.mark.parametrize("gqa_ratio", [1, 4])
@pytest.mark.parametrize("case_name", list(CASES))
def test_windowed_layers_match_the_reference(case_name, gqa_ratio, softcap):
    mode, prefix_lens, extend_lens, window = CASES[case_name]
    num_heads = KV_HEADS * gqa_ratio
    case = windowed_case(mode, prefix_lens, extend_lens, num_heads, seed=len(case_name))
    layer = PagedAttention(0, num_heads, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5,
                           sliding_window=window, logit_softcap=softcap)
    check(case, layer, window, softcap)


@pytest.mark.parametrize("mode", [E, D], ids=str)
@pytest.mark.parametrize("gqa_ratio", [1, 4])
def test_softcap_without_window_matches_the_reference(mode, gqa_ratio):
    prefix_lens, extend_lens = ([0, 9, 3], [12, 3, 1]) if mode is E else ([5, 17], [1, 1])
    case = windowed_case(mode, prefix_lens, extend_lens, KV_HEADS * gqa_ratio, page_size=4)
    # Scores near the cap, where tanh bends them most.
    case.q.mul_(3.0)
    layer = PagedAttention(0, KV_HEADS * gqa_ratio, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5,
                           logit_softcap=2.5)
    check(case, layer, None, 2.5)


def test_the_reference_tells_a_window_apart_from_none():
    """The cases can fail: the unwindowed answer is not the windowed one."""
    mode, prefix_lens, extend_lens, window = CASES["extend_after_prefix_longer_than_window"]
    case = windowed_case(mode, prefix_lens, extend_lens, KV_HEADS)
    layer = PagedAttention(0, KV_HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    prefixes = prefix_kv(case, 0)
    out = attend(case, layer).double()
    assert not torch.allclose(out, reference(case, prefixes, layer.scaling, window, None),
                              atol=1e-3)
    assert not torch.allclose(out, reference(case, prefixes, layer.scaling, None, 1.0),
                              atol=1e-3)


@pytest.mark.parametrize("softcap", [None, 4.0], ids=["no_cap", "cap"])
@pytest.mark.parametrize("case_name", ["extend_after_prefix_longer_than_window",
                                       "ragged_mixed_extend", "decode_ragged",
                                       "window_of_one"])
def test_a_slot_mapped_layer_reads_its_keys_through_the_map(case_name, softcap):
    mode, prefix_lens, extend_lens, window = CASES[case_name]
    case = windowed_case(mode, prefix_lens, extend_lens, KV_HEADS * 2, page_size=2)
    map_pool(case, window, seed=5)
    layer = PagedAttention(MAPPED_LAYER, KV_HEADS * 2, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5,
                           sliding_window=window, logit_softcap=softcap)
    check(case, layer, window, softcap)
    # The unmapped layer of the same pool takes the plain paths and still reads its slots.
    plain = PagedAttention(0, KV_HEADS * 2, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    check(case, plain, None, None)


def test_chunked_extends_see_the_previous_chunk_through_the_window():
    """A prompt in three chunks over one pool equals the reference over the whole prompt."""
    window, chunks = 6, [9, 5, 7]
    total = sum(chunks)
    full = windowed_case(E, [0], [total], KV_HEADS * 2, page_size=4)
    layer = PagedAttention(0, KV_HEADS * 2, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5,
                           sliding_window=window, logit_softcap=3.0)
    expected = reference(full, [(full.k[:0], full.v[:0])], layer.scaling, window, 3.0)
    outs, done = [], 0
    for n in chunks:
        outs.append(attend(chunk_of(full, done, n), layer))
        done += n
    torch.testing.assert_close(torch.cat(outs).double(), expected, atol=2e-5, rtol=2e-5)


def chunk_of(full, done: int, n: int):
    """The chunk of ``full``'s one prompt from token ``done``, ``n`` tokens, after the
    ``done`` tokens before it as cached prefix (same pool, same request row)."""
    b = full.batch
    row = int(b.req_pool_indices[0])
    slots = b.req_to_token[row, done : done + n]
    batch = replace(
        b, input_ids=b.input_ids[:n], positions=torch.arange(done, done + n),
        out_cache_loc=slots.clone(), seq_lens=torch.tensor([done + n]),
        prefix_lens=torch.tensor([done]), extend_seq_lens=torch.tensor([n]),
        seq_lens_list=[done + n], extend_seq_lens_list=[n])
    return types.SimpleNamespace(batch=batch, q=full.q[done : done + n],
                                 k=full.k[done : done + n], v=full.v[done : done + n])


def test_shared_prefix_decode_serves_windowed_layers_over_their_window():
    """Beams sharing a prompt: a windowed layer is right although the plain layers of the
    same batch read the shared prefix once."""
    case = windowed_case(D, [24, 24, 24], [1, 1, 1], KV_HEADS * 2, seed=11)
    batch = case.batch
    rows = batch.req_pool_indices.tolist()
    for row in rows[1:]:
        batch.req_to_token[row, :20] = batch.req_to_token[rows[0], :20]
    batch.shared_prefixes = [(0, 3, 20)]
    for window in (None, 7):
        layer = PagedAttention(0, KV_HEADS * 2, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5,
                               sliding_window=window)
        check(case, layer, window, None)
        assert batch.attn_backend._layout.shared  # the plain layers' runs are planned


def test_windowed_layers_never_reach_the_fused_prefill_kernel(monkeypatch):
    """Where the fused CPU kernels' causal prefill attention would attend an extend batch,
    windowed and soft-capped layers go around it (it has neither)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a windowed layer reached the fused prefill kernel")

    monkeypatch.setattr(fused_ops, "causal_prefill_attention", lambda *a, **k: refuse)
    case = windowed_case(E, [9, 0], [4, 6], KV_HEADS)
    for window, softcap in ((4, None), (None, 5.0), (4, 5.0)):
        layer = PagedAttention(0, KV_HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5,
                               sliding_window=window, logit_softcap=softcap)
        check(case, layer, window, softcap)
    assert isinstance(case.batch.attn_backend._layout, torch_native_backend._InPoolExtend)


@pytest.fixture
def kernels_on():
    kernels = enable_or_skip()
    yield kernels
    fused_ops.disable()


@pytest.mark.parametrize("softcap", [None, 3.0], ids=["no_cap", "cap"])
@pytest.mark.parametrize("mapped", [False, True], ids=["slots", "slot_map"])
@pytest.mark.parametrize("window", [1, 6, 64, None])
def test_windowed_decode_runs_in_the_pool_over_the_window_alone(kernels_on, monkeypatch,
                                                                window, mapped, softcap):
    """With the fused kernels on, a windowed or soft-capped decode attends in the pool
    through a table of the window's keys: the kernel is handed at most W keys a request,
    and the cap."""
    handed = []
    real = kernels_on.paged_decode_attention

    def recording(q, k_buffer, v_buffer, slots, lens, scale, cap=0.0):
        handed.append((lens.clone(), cap))
        return real(q, k_buffer, v_buffer, slots, lens, scale, cap)

    monkeypatch.setattr(fused_ops, "for_tensor", lambda tensor: types.SimpleNamespace(
        paged_decode_attention=recording))
    case = windowed_case(D, [4, 40, 9, 0], [1, 1, 1, 1], KV_HEADS * 4, page_size=2)
    layer_id = 0
    if mapped:
        map_pool(case, window, seed=8)
        layer_id = MAPPED_LAYER
    layer = PagedAttention(layer_id, KV_HEADS * 4, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5,
                           sliding_window=window, logit_softcap=softcap)
    case.q.mul_(3.0)  # scores reach the cap
    check(case, layer, window, softcap)
    ((lens, cap),) = handed
    assert lens.tolist() == [min(n, window or n) for n in case.batch.seq_lens_list]
    assert cap == (softcap or 0.0)


def test_pool_decode_tables_are_withheld_from_a_pool_that_maps_slots(monkeypatch):
    monkeypatch.setattr(fused_ops, "for_tensor", lambda tensor: object())
    case = windowed_case(D, [9, 3], [1, 1], KV_HEADS)
    backend = TorchNativeAttentionBackend()
    backend.init_forward_metadata(case.batch)
    assert backend.pool_decode_tables(case.batch) is not None
    map_pool(case, 4, seed=2)
    backend.init_forward_metadata(case.batch)
    assert backend.pool_decode_tables(case.batch) is None


def test_layouts_are_built_once_a_batch_per_window_and_map(monkeypatch):
    built = []
    real = windowed_attention.build_layout

    def counting(fb, window, slot_map):
        built.append((window, slot_map is None))
        return real(fb, window, slot_map)

    monkeypatch.setattr(windowed_attention, "build_layout", counting)
    case = windowed_case(E, [5, 0], [3, 4], KV_HEADS)
    backend = TorchNativeAttentionBackend()
    backend.init_forward_metadata(case.batch)
    for window, softcap in ((4, None), (4, 2.0), (None, 2.0), (4, None), (None, 3.0)):
        layer = PagedAttention(0, KV_HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5,
                               sliding_window=window, logit_softcap=softcap)
        backend.forward(case.q, case.k, case.v, layer, case.batch)
    assert built == [(4, True), (None, True)]
    assert torch_native_backend.needs_windowed_path is windowed_attention.needs_windowed_path


@pytest.mark.parametrize("mode, prefix_lens, extend_lens", [
    (E, [0, 14], [12, 3]), (D, [20, 3], [1, 1])], ids=["extend", "decode"])
@pytest.mark.parametrize("softcap", [None, 3.0], ids=["no_cap", "cap"])
def test_bfloat16_windowed_layers_match_the_reference(mode, prefix_lens, extend_lens, softcap):
    """In the pool's bfloat16, to bfloat16's precision (soft-capped scores in float32)."""
    case = windowed_case(mode, prefix_lens, extend_lens, KV_HEADS * 2)
    pool = case.batch.kv_pool
    pool.dtype = torch.bfloat16
    pool.k_buffers = [b.to(torch.bfloat16) for b in pool.k_buffers]
    pool.v_buffers = [b.to(torch.bfloat16) for b in pool.v_buffers]
    case.q, case.k, case.v = (x.to(torch.bfloat16) for x in (case.q, case.k, case.v))
    layer = PagedAttention(0, KV_HEADS * 2, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5,
                           sliding_window=6, logit_softcap=softcap)
    prefixes = prefix_kv(case, 0)
    out = attend(case, layer)
    assert out.dtype == torch.bfloat16
    expected = reference(case, prefixes, layer.scaling, 6, softcap)
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=3e-2)
