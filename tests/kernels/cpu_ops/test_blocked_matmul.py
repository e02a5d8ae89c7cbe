"""blocked_matmul: float32 rows against 16-bit weights in column blocks."""

from __future__ import annotations

import pytest
import torch

from radixlm.models.layers.weight_storage import BLOCK_COLUMNS


def column_blocks(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) -> (N / 16, K, 16), blocks[b, k, j] = weight[16 b + j, k]."""
    out_features, in_features = weight.shape
    return weight.view(out_features // BLOCK_COLUMNS, BLOCK_COLUMNS, in_features).transpose(
        1, 2).contiguous()


@pytest.mark.parametrize("stored_as", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 6, 7, 16])  # a wide tile; a whole tile; a rest
@pytest.mark.parametrize("out_features, in_features", [
    (16, 64),  # one block
    (48, 70),  # an odd number of blocks, a span of 64 and a rest of 6
    (1024, 576),
])
def test_blocked_matmul_multiplies_by_the_stored_weight(kernels, stored_as, rows, out_features,
                                                        in_features):
    """float64's product to one float32 step (of the sum of |x| |w|)."""
    torch.manual_seed(rows + out_features)
    weight = (torch.randn(out_features, in_features) * 0.05).to(stored_as)
    x = torch.randn(rows, 2 * in_features)[:, ::2]  # a strided view
    got = kernels.blocked_matmul(x, column_blocks(weight))
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    expected = x.double() @ weight.double().T
    magnitude = x.double().abs() @ weight.double().abs().T
    assert ((got.double() - expected).abs() <= 1e-6 * magnitude + 1e-30).all()


def test_blocked_matmul_errs_no_more_than_the_row_kernel(kernels):
    """Summed in spans of k, not along all of K at once: over K = 1536 (the default model's
    down projection) the error against float64 stays within the row kernel's."""
    torch.manual_seed(0)
    weight = torch.randn(576, 1536).bfloat16()
    x = torch.randn(16, 1536)
    expected = x.double() @ weight.double().T
    blocked = (kernels.blocked_matmul(x, column_blocks(weight)).double() - expected).abs()
    by_rows = (kernels.dense_matmul(x, weight).double() - expected).abs()
    assert blocked.mean() <= 1.1 * by_rows.mean()
    assert blocked.max() <= 1.5 * by_rows.max()


@pytest.mark.parametrize("stored_as", [torch.bfloat16, torch.float16])
def test_a_row_gets_the_same_products_in_any_pass(kernels, stored_as):
    """Alone, two at a time (the wide tiles), in a whole tile of 6 or in the rest after the
    tiles: bit for bit (a decode step's batch does not change a request's tokens)."""
    torch.manual_seed(4)
    x = torch.randn(39, 72)
    blocks = column_blocks(torch.randn(80, 72).to(stored_as))
    whole = kernels.blocked_matmul(x, blocks)
    for first, count in [(0, 1), (38, 1), (3, 2), (5, 3), (8, 6), (2, 13), (0, 39)]:
        part = kernels.blocked_matmul(x[first:first + count], blocks)
        assert torch.equal(part, whole[first:first + count])


def test_blocked_matmul_rejects_arguments_that_do_not_fit(kernels):
    blocks = column_blocks(torch.randn(32, 8).bfloat16())
    x = torch.randn(3, 8)
    assert kernels.blocked_matmul(x[:0], blocks).shape == (0, 32)
    with pytest.raises(RuntimeError, match="x must be"):
        kernels.blocked_matmul(x.bfloat16(), blocks)
    with pytest.raises(RuntimeError, match="blocks must be a contiguous"):
        kernels.blocked_matmul(torch.randn(3, 9), blocks)
    with pytest.raises(RuntimeError, match="blocks must be a contiguous"):
        kernels.blocked_matmul(x, blocks.transpose(0, 1))
    with pytest.raises(RuntimeError, match="blocks must be a contiguous"):
        kernels.blocked_matmul(x, torch.zeros(2, 8, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        kernels.blocked_matmul(x, blocks.float())
