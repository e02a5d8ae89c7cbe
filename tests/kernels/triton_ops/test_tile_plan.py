"""The attention kernels' tiles per GPU architecture (``triton_ops/tile_plan.py``), computed
without a GPU: every choice fits the architecture's shared memory, 16-bit tiles shrink only
where they must, float32 MLA prefill is refused where nothing fits, and the CPU (the
interpreter) keeps the tiles asked for. ``test_gpu_compile.py`` checks the estimates
against Triton's compiler."""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels.triton_ops import tile_plan
from radixlm.kernels.triton_ops.extend_attention import extend_attention
from radixlm.kernels.triton_ops.tile_plan import (
    SHARED_MEMORY_PER_BLOCK,
    Tiles,
    extend_tiles,
    mla_decode_tiles,
)

pytestmark = pytest.mark.triton

BF16, F32 = torch.bfloat16, torch.float32
MLA_K, MLA_V = 576, 512  # DeepSeek: a 512 latent + 64 RoPE key, the latent as value
# (head_dim_k, head_dim_v, dtype) -> (block_m, block_n) per sm_80, sm_86, sm_89, sm_90,
# asked for 64 x 64 (TritonBackendConfig's GPU tiles).
EXTEND_TILES = {
    (64, 64, BF16): [(64, 64)] * 4,  # SmolLM2-135M
    (128, 128, BF16): [(64, 64)] * 4,
    (128, 128, F32): [(64, 64)] * 4,
    (256, 256, F32): [(64, 64), (32, 32), (32, 32), (64, 64)],
    (MLA_K, MLA_V, BF16): [(32, 32), (32, 16), (32, 16), (32, 32)],
    (MLA_K, MLA_V, F32): [(16, 16), None, None, (32, 16)],  # None: refused
}
ARCHS = sorted(SHARED_MEMORY_PER_BLOCK)


@pytest.mark.parametrize("heads", list(EXTEND_TILES), ids=lambda h: f"{h[0]}x{h[1]}-{h[2]}")
def test_extend_tiles_fit_each_architectures_shared_memory(heads):
    for arch, expected in zip(ARCHS, EXTEND_TILES[heads], strict=True):
        limit = SHARED_MEMORY_PER_BLOCK[arch]
        if expected is None:
            with pytest.raises(ValueError, match="shared memory"):
                extend_tiles(*heads, limit)
            continue
        tiles = extend_tiles(*heads, limit)
        assert (tiles.block_m, tiles.block_n) == expected, f"sm_{arch}"
        assert tiles.num_stages == 1 and tiles.shared_bytes <= limit


def test_mla_prefill_tiles_of_sm90_overflow_an_sm86():
    """The defect: 32 x 32 MLA tiles take 128 KiB, more than an A10 / L4 / L40S has."""
    sm90 = extend_tiles(MLA_K, MLA_V, BF16, SHARED_MEMORY_PER_BLOCK[90])
    assert (sm90.block_m, sm90.block_n) == (32, 32)
    assert sm90.shared_bytes > SHARED_MEMORY_PER_BLOCK[86]


def test_float32_mla_prefill_is_refused_on_a_99_kib_gpu_saying_what_to_use():
    with pytest.raises(ValueError) as refused:
        extend_tiles(MLA_K, MLA_V, F32, SHARED_MEMORY_PER_BLOCK[86])
    message = str(refused.value)
    assert "torch.float32" in message and "576-wide keys" in message
    assert "bfloat16" in message and "torch_native" in message


def test_the_wrapper_refuses_before_launching(monkeypatch):
    monkeypatch.setattr(tile_plan, "shared_memory_per_block",
                        lambda device: SHARED_MEMORY_PER_BLOCK[89])
    q = torch.zeros(2, 4, MLA_K)
    k = torch.zeros(2, 1, MLA_K)
    pool = torch.zeros(8, 1, MLA_K)
    lens = torch.tensor([2])
    zero = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="needs .* bytes of shared memory"):
        extend_attention(q, k, k[..., :MLA_V], torch.empty(2, 4, MLA_V), pool,
                         pool[..., :MLA_V], torch.zeros(1, 8, dtype=torch.int64), zero, zero,
                         lens, zero, 2, 0.1, block_m=64, block_n=64)


@pytest.mark.parametrize("asked", [(64, 64), (16, 16)])
def test_without_a_gpu_the_tiles_asked_for_are_kept(asked):
    assert extend_tiles(64, 64, F32, None, *asked) == Tiles(*asked, None, None)
    # wide heads keep their register cap, as before tiles were planned
    assert extend_tiles(MLA_K, MLA_V, F32, None, *asked) == Tiles(
        min(asked[0], 32), min(asked[1], 32), None, None)
    assert tile_plan.shared_memory_per_block(torch.device("cpu")) is None


@pytest.mark.parametrize("dtype, expected", [(BF16, [64, 64, 64, 64]),
                                             (F32, [32, 16, 16, 64])])
def test_mla_decode_key_tiles_fit_each_architecture(dtype, expected):
    for arch, block_n in zip(ARCHS, expected, strict=True):
        limit = SHARED_MEMORY_PER_BLOCK[arch]
        tiles = mla_decode_tiles(512, 64, dtype, limit)
        assert (tiles.block_m, tiles.block_n) == (16, block_n), f"sm_{arch}"
        assert tiles.shared_bytes <= limit
    assert mla_decode_tiles(512, 64, dtype, None) == Tiles(16, 64, None, None)


def test_mla_decode_that_fits_no_tile_is_refused():
    with pytest.raises(ValueError, match="MLA decode in torch.float32"):
        mla_decode_tiles(512, 64, F32, 48 * 1024)
