"""The fused kernels' ``argmax_rows`` (``argmax.cpp``) gives ``x.argmax(dim=-1)`` exactly:
random rows of every length around its vector width, ties (the first index wins), a NaN
(the first NaN wins, wherever it lies), infinities, rows of -inf, strided rows."""

from __future__ import annotations

import pytest
import torch

LENGTHS = [1, 2, 15, 16, 17, 31, 32, 33, 100, 1000, 49152]


def variants(x: torch.Tensor) -> list[torch.Tensor]:
    """x and rows built to test the rules: ties, NaN, infinities."""
    rows, length = x.shape
    out = [x, x.round(), torch.full_like(x, 0.5), torch.full_like(x, float("-inf"))]
    for at in {0, length // 2, length - 1}:
        nan = x.clone()
        nan[-1, at] = float("nan")
        nan[0, (at + 1) % length] = float("inf")
        out.append(nan)
        twice = x.clone()
        twice[:, at] = twice[:, -1] = 100.0  # the same largest value twice
        out.append(twice)
    return out


@pytest.mark.parametrize("length", LENGTHS)
def test_it_gives_torch_argmax_exactly(kernels, length):
    gen = torch.Generator().manual_seed(length)
    for x in variants(torch.randn(5, length, generator=gen)):
        assert torch.equal(kernels.argmax_rows(x), x.argmax(dim=-1)), x


def test_it_reads_rows_with_a_stride_and_rejects_what_it_cannot_take(kernels):
    x = torch.randn(4, 70)[:, :50]
    assert torch.equal(kernels.argmax_rows(x), x.argmax(dim=-1))
    with pytest.raises(RuntimeError, match="float32"):
        kernels.argmax_rows(x.double())
    with pytest.raises(RuntimeError, match="unit stride"):
        kernels.argmax_rows(torch.randn(50, 4).t())
    with pytest.raises(RuntimeError, match="V >= 1"):
        kernels.argmax_rows(torch.randn(3, 0))
