"""The column-pair matmul kernel (``pair_matmul.cpp``) computes what ``x @ w.T`` computes:
against float64 it errs no more than one bfloat16 step of the sum of |x| |w|, for every tail
of its row tiles (8, 4, 2, 1) and column chunks (3 or 4 groups of 16), strided rows and any
thread count; a row's products are the same bits whatever rows share its pass; it rejects
what it cannot take."""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels.cpu_ops import fused_ops
from radixlm.models.layers.cpu_weight_layout import PairedWeight


@pytest.fixture(scope="module")
def kernel(kernels):
    if not kernels.pair_matmul_available():
        pytest.skip("this CPU has no AVX-512 BF16")
    return kernels.pair_matmul


def pairs_of(weight: torch.Tensor) -> torch.Tensor:
    return PairedWeight.pack(weight).pairs


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8, 13, 16, 27, 64])
@pytest.mark.parametrize("out_features, in_features",
                         [(16, 2), (48, 64), (112, 34), (80, 1536), (960, 576)])
def test_it_computes_what_x_times_w_transposed_computes(kernel, rows, out_features,
                                                        in_features):
    torch.manual_seed(rows * 7 + out_features)
    weight = (torch.randn(out_features, in_features) * 0.05).bfloat16()
    x = torch.randn(rows, in_features).bfloat16()
    got = kernel(x, pairs_of(weight))
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    expected = x.double() @ weight.double().T
    magnitude = x.double().abs() @ weight.double().abs().T
    assert ((got.double() - expected).abs() <= 2**-8 * magnitude + 1e-30).all()


def test_a_rows_products_do_not_depend_on_the_rows_beside_it(kernel):
    """Passes of any size give each row the same bits (a prompt's rows after a cache hit
    equal the whole prompt's), also on one thread and strided."""
    torch.manual_seed(0)
    weight = (torch.randn(208, 576) * 0.05).bfloat16()
    pairs = pairs_of(weight)
    x = torch.randn(40, 576).bfloat16()
    whole = kernel(x, pairs)
    for begin, end in [(0, 1), (5, 6), (3, 11), (8, 16), (17, 40), (0, 39)]:
        assert torch.equal(kernel(x[begin:end], pairs), whole[begin:end])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(kernel(x, pairs), whole)
    finally:
        torch.set_num_threads(threads)
    strided = torch.randn(40, 1152).bfloat16()[:, ::2]
    assert torch.equal(kernel(strided, pairs), kernel(strided.contiguous(), pairs))
    assert kernel(x[:0], pairs).shape == (0, 208)


def test_it_rejects_arguments_that_do_not_fit(kernel):
    weight = torch.randn(32, 64).bfloat16()
    pairs = pairs_of(weight)
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        kernel(x.float(), pairs)
    with pytest.raises(RuntimeError, match=r"x must be \(M, K\)"):
        kernel(torch.randn(2, 62).bfloat16(), pairs)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel(x, weight)  # the plain (N, K) weight
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel(x, pairs.transpose(0, 1))


def test_it_serves_where_amx_does_not_run_onednn(kernel):
    """With the kernels on, on a CPU without AMX (oneDNN's own kernels run on its tiles)."""
    assert fused_ops.pair_matmul_serves() == ("amx_bf16" not in fused_ops._cpu_flags())
    fused_ops.disable()
    try:
        assert not fused_ops.pair_matmul_serves()
    finally:
        fused_ops.enable()
