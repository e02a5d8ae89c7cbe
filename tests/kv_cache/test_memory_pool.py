"""Token-to-KV pools: the MHA layout (K and V per KV head) and the MLA latent layout (one row
of latent + RoPE key per token, values a view of it)."""

from __future__ import annotations

import pytest
import torch

from radixlm.kv_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_pool_bytes_per_token_count_one_row_per_layer(dtype):
    pool = MLATokenToKVPool(16, 3, kv_lora_rank=32, qk_rope_head_dim=8, dtype=dtype,
                            device="cpu")
    size = torch.tensor([], dtype=dtype).element_size()
    assert pool.bytes_per_token() == (32 + 8) * 3 * size
    mha = MHATokenToKVPool(16, 3, num_kv_heads=4, head_dim=10, dtype=dtype, device="cpu")
    assert mha.bytes_per_token() == 2 * 4 * 10 * 3 * size


def test_latent_pool_values_are_a_view_of_the_key_rows_never_a_copy():
    pool = MLATokenToKVPool(8, 2, kv_lora_rank=6, qk_rope_head_dim=2, dtype=torch.float32,
                            device="cpu")
    assert pool.values_view_keys and not MHATokenToKVPool.values_view_keys
    rows = torch.arange(3 * 8, dtype=torch.float32).view(3, 1, 8)
    slots = torch.tensor([5, 1, 6])
    pool.set_kv(1, slots, rows, rows[..., :6])
    keys, values = pool.get_kv(1)
    assert keys.shape == (8, 1, 8) and values.shape == (8, 1, 6)
    assert values.data_ptr() == keys.data_ptr()  # same storage
    assert torch.equal(keys[slots], rows) and torch.equal(values[slots], rows[..., :6])
    keys[2, 0, 0] = 42.0  # a write to a key row is seen by the values
    assert values[2, 0, 0] == 42.0
    untouched = torch.tensor([0, 2, 3, 4, 7])
    assert not keys[untouched][:, :, 1:].any() and not pool.kv_buffers[0].any()
