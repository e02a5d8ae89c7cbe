"""TritonAttentionBackend against the torch-native backend over random paged batches.

On the GPU where there is one (``KERNEL_DEVICE``), else under ``TRITON_INTERPRET=1`` (set by
conftest) on the CPU; in float32, on the interpreter's small tiles. Each case: ragged prefix
and extend lengths, requests scattered over random pool pages and rows, garbage in every
unused slot, GQA ratios 1, 4 and 8, pages of 1 and 16.
"""

from __future__ import annotations

import pytest
import torch
from kernel_device import KERNEL_DEVICE
from paged_cases import NUM_LAYERS, clone_pool, random_lengths, random_paged_batch

from radixlm.kernels.attention.torch_native_backend import TorchNativeAttentionBackend
from radixlm.kernels.attention.triton_backend import TritonAttentionBackend, TritonBackendConfig
from radixlm.kernels.forward_batch import ForwardMode
from radixlm.models.layers.attention import PagedAttention

pytestmark = pytest.mark.triton

KV_HEADS = 2
HEAD_DIM = 16
LAYER = 1


def run_both(case, num_heads, config=None):
    """(triton output, reference output, triton pool, reference pool) for one layer."""
    batch = case.batch
    layer = PagedAttention(LAYER, num_heads, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    reference_pool = clone_pool(batch.kv_pool)
    triton_pool = batch.kv_pool

    batch.kv_pool, batch.attn_backend = reference_pool, TorchNativeAttentionBackend()
    batch.attn_backend.init_forward_metadata(batch)
    expected = batch.attn_backend.forward(case.q, case.k, case.v, layer, batch)

    batch.kv_pool = triton_pool
    batch.attn_backend = TritonAttentionBackend(config or TritonBackendConfig.for_device(
        torch.device("cpu")))
    batch.attn_backend.init_forward_metadata(batch)
    out = batch.attn_backend.forward(case.q, case.k, case.v, layer, batch)
    return out, expected, triton_pool, reference_pool


def assert_same_pools(pool, reference):
    for layer in range(NUM_LAYERS):
        assert torch.equal(pool.k_buffers[layer], reference.k_buffers[layer])
        assert torch.equal(pool.v_buffers[layer], reference.v_buffers[layer])


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("gqa_ratio", [1, 4, 8])
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE], ids=str)
def test_matches_torch_native_on_random_paged_batches(mode, gqa_ratio, page_size):
    seed = 10 * gqa_ratio + page_size
    prefix_lens, extend_lens = random_lengths(mode, 4, max_prefix=40, max_extend=24, seed=seed)
    prefix_lens[0] = 0  # always one fresh request
    num_heads = KV_HEADS * gqa_ratio
    case = random_paged_batch(
        mode, prefix_lens, extend_lens, num_heads, KV_HEADS, HEAD_DIM, page_size, seed,
        KERNEL_DEVICE,
    )
    out, expected, pool, reference_pool = run_both(case, num_heads)
    assert out.shape == expected.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    assert_same_pools(pool, reference_pool)


@pytest.mark.parametrize(
    "prefix_lens, extend_lens",
    [([0], [1]), ([0], [37]), ([33], [1]), ([5, 0, 17], [16, 33, 1])],
    ids=["one_token_prompt", "long_fresh_prompt", "one_token_after_prefix", "block_edges"],
)
def test_extend_edge_lengths(prefix_lens, extend_lens):
    """Lengths on and around the 16-token tiles: empty and partial blocks of both phases."""
    case = random_paged_batch(
        ForwardMode.EXTEND, prefix_lens, extend_lens, 8, KV_HEADS, HEAD_DIM, 1, seed=3,
        device=KERNEL_DEVICE,
    )
    out, expected, pool, reference_pool = run_both(case, 8)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    assert_same_pools(pool, reference_pool)


@pytest.mark.parametrize("num_kv_splits", [1, 3, 16])
def test_decode_merges_any_number_of_splits(num_kv_splits):
    """More splits than keys (empty splits), one split, an odd count: all merge exactly."""
    prefix_lens = [0, 2, 15, 46]
    case = random_paged_batch(
        ForwardMode.DECODE, prefix_lens, [1] * 4, 4, KV_HEADS, HEAD_DIM, 16, seed=num_kv_splits,
        device=KERNEL_DEVICE,
    )
    config = TritonBackendConfig(
        num_kv_splits=num_kv_splits, extend_block_m=16, extend_block_n=16, decode_block_n=16
    )
    out, expected, _, _ = run_both(case, 4, config)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_every_layer_of_a_batch_reads_its_own_kv():
    """Metadata is built once per batch; each layer stores into and reads its own buffers."""
    case = random_paged_batch(
        ForwardMode.EXTEND, [3, 9], [5, 2], 4, KV_HEADS, HEAD_DIM, 16, seed=11,
        device=KERNEL_DEVICE,
    )
    batch = case.batch
    reference_pool = clone_pool(batch.kv_pool)
    backend = TritonAttentionBackend()
    reference = TorchNativeAttentionBackend()
    backend.init_forward_metadata(batch)
    reference.init_forward_metadata(batch)
    for layer_id in range(NUM_LAYERS):
        layer = PagedAttention(layer_id, 4, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
        out = backend.forward_extend(case.q, case.k, case.v, layer, batch)
        pool, batch.kv_pool = batch.kv_pool, reference_pool
        expected = reference.forward_extend(case.q, case.k, case.v, layer, batch)
        batch.kv_pool = pool
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    assert_same_pools(batch.kv_pool, reference_pool)


def test_config_rejects_tiles_that_are_not_powers_of_two():
    with pytest.raises(ValueError, match="extend_block_m must be a power of two"):
        TritonBackendConfig(extend_block_m=24)
    with pytest.raises(ValueError, match="num_kv_splits must be a positive integer"):
        TritonBackendConfig(num_kv_splits=0)
