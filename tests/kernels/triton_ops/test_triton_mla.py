"""Triton attention over MLA's latent pool against the torch-native backend (float32, on the CPU
interpreter or the GPU: ``KERNEL_DEVICE``): the MLA decode kernel and the extend kernel with
values narrower than keys.

Rows are [c_kv : D_l | k_rope : D_r]; the key is the row, the value its first D_l dims
(``MLATokenToKVPool``). Shapes: a tiny one (D_l 32, D_r 8, as the tiny DeepSeek models)
with head counts that do and do not fill a 16-head tile, and DeepSeek-V2-Lite's own
(D_l 512, D_r 64, 16 heads).
"""

from __future__ import annotations

import pytest
import torch
from kernel_device import KERNEL_DEVICE
from paged_cases import (
    random_latent_pool,
    random_lengths,
    random_paged_batch,
    torch_native_reference,
)

from radixlm.kernels.attention.triton_backend import TritonAttentionBackend
from radixlm.kernels.forward_batch import ForwardMode
from radixlm.kernels.triton_ops import tile_plan
from radixlm.models.layers.attention import PagedAttention

pytestmark = pytest.mark.triton

LAYER = 1


def latent_case(mode, prefix_lens, extend_lens, num_heads, latent, rope, page_size, seed):
    """A paged batch over a random latent pool: q (T, H, D_l + D_r), k (T, 1, D_l + D_r)."""
    row = latent + rope
    case = random_paged_batch(
        mode, prefix_lens, extend_lens, num_heads, 1, row, page_size, seed, KERNEL_DEVICE
    )
    case.batch.kv_pool = random_latent_pool(case.batch.kv_pool.num_slots, latent, rope,
                                            torch.float32, KERNEL_DEVICE, seed + 1)
    return case, PagedAttention(LAYER, num_heads, 1, row, row**-0.5, v_head_dim=latent)


def compare(case, layer):
    batch = case.batch
    v = case.k[..., : layer.v_head_dim]  # the view the MLA layer passes
    expected, reference_pool = torch_native_reference(case, v, layer)
    triton_pool = batch.kv_pool
    backend = TritonAttentionBackend()
    backend.init_forward_metadata(batch)
    out = backend.forward(case.q, case.k, v, layer, batch)
    assert out.shape == (case.q.shape[0], layer.num_heads, layer.v_head_dim)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    for mine, theirs in zip(triton_pool.kv_buffers, reference_pool.kv_buffers, strict=True):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("num_heads", [4, 20])
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE], ids=str)
def test_latent_attention_matches_torch_native(mode, num_heads, page_size):
    seed = num_heads + page_size
    prefix_lens, extend_lens = random_lengths(mode, 3, max_prefix=40, max_extend=20, seed=seed)
    case, layer = latent_case(mode, prefix_lens, extend_lens, num_heads, 32, 8, page_size, seed)
    compare(case, layer)


def float32_mla_prefill_fits() -> bool:
    """False on a GPU whose shared memory takes no float32 MLA prefill tile (sm_86, sm_89)."""
    try:
        tile_plan.extend_tiles(576, 512, torch.float32,
                               tile_plan.shared_memory_per_block(KERNEL_DEVICE))
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND], ids=str)
def test_latent_attention_at_deepseek_v2_lite_shapes(mode):
    prefix_lens, extend_lens = [9, 0], ([1, 1] if mode is ForwardMode.DECODE else [3, 5])
    case, layer = latent_case(mode, prefix_lens, extend_lens, 16, 512, 64, 16, seed=2)
    if mode is ForwardMode.EXTEND and not float32_mla_prefill_fits():
        with pytest.raises(ValueError, match="shared memory"):
            compare(case, layer)
        return
    compare(case, layer)
