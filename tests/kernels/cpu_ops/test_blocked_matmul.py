"""blocked_matmul and blocked_int8_matmul: float32 rows against 16-bit or int8 weights in
column blocks."""

from __future__ import annotations

import pytest
import torch

from radixlm.models.layers.column_layouts import by_column_blocks as column_blocks
from radixlm.models.layers.column_layouts import from_column_blocks


def int8_weight(out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random int8 integers (out, in) over the whole range, and positive scales (out,)."""
    integers = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8)
    return integers, torch.rand(out_features) * 0.01 + 1e-4


def test_the_layout_puts_16_outputs_weights_of_one_input_side_by_side():
    weight = torch.arange(48 * 5).view(48, 5)
    blocks = column_blocks(weight)
    assert blocks.shape == (3, 5, 16) and blocks.is_contiguous()
    assert blocks[2, 4, 7] == weight[2 * 16 + 7, 4]
    assert torch.equal(from_column_blocks(blocks), weight)
    with pytest.raises(ValueError, match="multiple of 16"):
        column_blocks(torch.zeros(40, 5))


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


@pytest.mark.parametrize("rows", [1, 2, 6, 16, 40])
@pytest.mark.parametrize("out_features, in_features", [(16, 64), (48, 70), (1024, 576)])
def test_blocked_int8_matmul_multiplies_by_the_scaled_integers(kernels, rows, out_features,
                                                               in_features):
    """Each output's sum over the integers, times its scale: float64's product to one
    float32 step (of the sum of |x| |w|)."""
    torch.manual_seed(rows + out_features)
    integers, scales = int8_weight(out_features, in_features)
    x = torch.randn(rows, 2 * in_features)[:, ::2]  # a strided view
    got = kernels.blocked_int8_matmul(x, column_blocks(integers), scales)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    weight = integers.double() * scales.double()[:, None]
    expected = x.double() @ weight.T
    magnitude = x.double().abs() @ weight.abs().T
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


@pytest.mark.parametrize("stored_as", [torch.bfloat16, torch.float16, torch.int8])
def test_a_row_gets_the_same_products_in_any_pass(kernels, stored_as):
    """Alone, two at a time (the wide tiles), in a whole tile of 6 or in the rest after the
    tiles: bit for bit (a decode step's batch does not change a request's tokens)."""
    torch.manual_seed(4)
    x = torch.randn(39, 72)
    if stored_as == torch.int8:
        integers, scales = int8_weight(80, 72)
        blocks = column_blocks(integers)

        def product(rows):
            return kernels.blocked_int8_matmul(rows, blocks, scales)
    else:
        blocks = column_blocks(torch.randn(80, 72).to(stored_as))

        def product(rows):
            return kernels.blocked_matmul(rows, blocks)
    whole = product(x)
    for first, count in [(0, 1), (38, 1), (3, 2), (5, 3), (8, 6), (2, 13), (0, 39)]:
        assert torch.equal(product(x[first:first + count]), whole[first:first + count])


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


def test_blocked_int8_matmul_rejects_arguments_that_do_not_fit(kernels):
    integers, scales = int8_weight(32, 8)
    blocks, x = column_blocks(integers), torch.randn(3, 8)
    assert kernels.blocked_int8_matmul(x[:0], blocks, scales).shape == (0, 32)
    with pytest.raises(RuntimeError, match="blocks must be int8"):
        kernels.blocked_int8_matmul(x, blocks.bfloat16(), scales)
    with pytest.raises(RuntimeError, match="scales must be"):
        kernels.blocked_int8_matmul(x, blocks, scales[:16])
    with pytest.raises(RuntimeError, match="scales must be"):
        kernels.blocked_int8_matmul(x, blocks, scales.double())
    with pytest.raises(RuntimeError, match="blocks must be a contiguous"):
        kernels.blocked_int8_matmul(torch.randn(3, 9), blocks, scales)
    with pytest.raises(RuntimeError, match="int8"):
        kernels.blocked_matmul(x, blocks)
