"""Sliding windows, logit soft-capping and slot maps in the Triton kernels (under
``TRITON_INTERPRET=1`` on CPUs, on ``KERNEL_DEVICE``) against the float64 reference of
``windowed_cases``, on 16-token tiles so windows fall inside, across and beyond the tiles."""

from __future__ import annotations

import pytest
import torch
from kernel_device import KERNEL_DEVICE
from windowed_cases import (
    HEAD_DIM,
    KV_HEADS,
    MAPPED_LAYER,
    map_pool,
    prefix_kv,
    reference,
    windowed_case,
)

from radixlm.kernels.attention.triton_backend import TritonAttentionBackend, TritonBackendConfig
from radixlm.kernels.forward_batch import ForwardMode
from radixlm.models.layers.attention import PagedAttention

pytestmark = pytest.mark.triton

E, D = ForwardMode.EXTEND, ForwardMode.DECODE
SMALL_TILES = TritonBackendConfig(num_kv_splits=3, extend_block_m=16, extend_block_n=16,
                                  decode_block_n=16)
# name: (mode, prefix lengths, extend lengths, window, softcap)
CASES = {
    "extend_windows_across_tiles": (E, [0, 37, 3], [35, 6, 20], 7, None),
    "extend_window_of_one_capped": (E, [5, 0], [18, 3], 1, 3.0),
    "extend_window_beyond_sequences_capped": (E, [10, 0], [6, 9], 100, 2.0),
    "extend_cap_without_window": (E, [20, 0], [4, 17], None, 2.0),
    "decode_windows_over_splits": (D, [60, 3, 17, 0], [1, 1, 1, 1], 20, None),
    "decode_window_of_one_capped": (D, [9, 30], [1, 1], 1, 4.0),
    "decode_cap_without_window": (D, [40, 2], [1, 1], None, 2.0),
}


def check(case, layer, window, softcap):
    prefixes = prefix_kv(case, layer.layer_id)
    batch = case.batch
    batch.attn_backend = TritonAttentionBackend(SMALL_TILES)
    batch.attn_backend.init_forward_metadata(batch)
    out = batch.attn_backend.forward(case.q, case.k, case.v, layer, batch)
    expected = reference(case, prefixes, layer.scaling, window, softcap)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)
    pool = batch.kv_pool
    slot_map = pool.slot_map_for(layer.layer_id)
    loc = batch.out_cache_loc if slot_map is None else slot_map[batch.out_cache_loc]
    assert torch.equal(pool.k_buffers[layer.layer_id][loc], case.k)
    assert torch.equal(pool.v_buffers[layer.layer_id][loc], case.v)


@pytest.mark.parametrize("gqa_ratio", [1, 4])
@pytest.mark.parametrize("case_name", list(CASES))
def test_triton_windowed_layers_match_the_reference(case_name, gqa_ratio):
    mode, prefix_lens, extend_lens, window, softcap = CASES[case_name]
    case = windowed_case(mode, prefix_lens, extend_lens, KV_HEADS * gqa_ratio, page_size=4,
                         seed=len(case_name), device=KERNEL_DEVICE)
    case.q.mul_(2.0)  # scores reach the cap
    layer = PagedAttention(0, KV_HEADS * gqa_ratio, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5,
                           sliding_window=window, logit_softcap=softcap)
    check(case, layer, window, softcap)


@pytest.mark.parametrize("case_name", ["extend_windows_across_tiles",
                                       "decode_windows_over_splits"])
def test_triton_reads_a_mapped_layer_through_its_slot_map(case_name):
    mode, prefix_lens, extend_lens, window, _ = CASES[case_name]
    case = windowed_case(mode, prefix_lens, extend_lens, KV_HEADS * 2, page_size=2,
                         device=KERNEL_DEVICE)
    map_pool(case, window, seed=4)
    layer = PagedAttention(MAPPED_LAYER, KV_HEADS * 2, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5,
                           sliding_window=window, logit_softcap=3.0)
    check(case, layer, window, 3.0)
