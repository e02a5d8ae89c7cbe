"""The column-pair matmul kernels (``pair_matmul.cpp``: bfloat16 weights, and int8 weights
with a scale a column) compute what ``x @ w.T`` computes: against float64 they err no more
than one bfloat16 step of the sum of |x| |w|, for every tail of their row tiles (8, 4, 2, 1)
and column chunks (3 or 4 groups of 16), strided rows and any thread count; a row's products
are the same bits whatever rows share its pass (int8 groups are widened per tile for up to
8 rows, once a chunk beyond); their gated forms give a gated MLP's silu(gate) * up with the
same bits as ``silu_mul`` of the products; they reject what they cannot take."""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels.cpu_ops import fused_ops
from radixlm.models.layers.cpu_weight_layout import PairedWeight
from radixlm.models.layers.weight_formats import ConversionBuffer, Int8Weight


@pytest.fixture(scope="module")
def kernel(kernels):
    if not kernels.pair_matmul_available():
        pytest.skip("this CPU has no AVX-512 BF16")
    return kernels.pair_matmul


def pairs_of(weight: torch.Tensor) -> torch.Tensor:
    return PairedWeight.pack(weight).pairs


@pytest.fixture(scope="module", params=["bfloat16", "int8"])
def by_pairs(request, kernel, kernels):
    """weight (N, K) float32 -> (x -> x @ w.T on the kernel of the weight's format, the
    float64 weight that format stands for)."""
    def prepare(weight: torch.Tensor):
        if request.param == "bfloat16":
            pairs = pairs_of(weight.bfloat16())
            return (lambda x: kernel(x, pairs)), weight.bfloat16().double()
        packed = Int8Weight.pack(weight, ConversionBuffer(), by_pairs=True)
        assert packed.weight is None and packed.pairs.dtype == torch.int8
        return ((lambda x: kernels.int8_pair_matmul(x, packed.pairs, packed.scales)),
                packed.dequantized().double())

    return prepare


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8, 13, 16, 27, 64])
@pytest.mark.parametrize("out_features, in_features",
                         [(16, 2), (48, 64), (112, 34), (80, 1536), (960, 576)])
def test_it_computes_what_x_times_w_transposed_computes(by_pairs, rows, out_features,
                                                        in_features):
    torch.manual_seed(rows * 7 + out_features)
    multiply, weight = by_pairs(torch.randn(out_features, in_features) * 0.05)
    x = torch.randn(rows, in_features).bfloat16()
    got = multiply(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    expected = x.double() @ weight.T
    magnitude = x.double().abs() @ weight.abs().T
    assert ((got.double() - expected).abs() <= 2**-8 * magnitude + 1e-30).all()


def test_a_rows_products_do_not_depend_on_the_rows_beside_it(by_pairs):
    """Passes of any size give each row the same bits (a prompt's rows after a cache hit
    equal the whole prompt's), also on one thread and strided."""
    torch.manual_seed(0)
    multiply, _ = by_pairs(torch.randn(208, 576) * 0.05)
    x = torch.randn(40, 576).bfloat16()
    whole = multiply(x)
    for begin, end in [(0, 1), (5, 6), (3, 11), (8, 16), (17, 40), (0, 39)]:
        assert torch.equal(multiply(x[begin:end]), whole[begin:end])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(multiply(x), whole)
    finally:
        torch.set_num_threads(threads)
    strided = torch.randn(40, 1152).bfloat16()[:, ::2]
    assert torch.equal(multiply(strided), multiply(strided.contiguous()))
    assert multiply(x[:0]).shape == (0, 208)


@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 40])
@pytest.mark.parametrize("intermediate", [16, 48, 80, 1536])  # 1, 3, 5, 96 groups a half
def test_the_gated_products_equal_silu_mul_of_the_products(kernel, kernels, weights, rows,
                                                           intermediate):
    """Chunks of 3 (8 rows and more) or 4 groups, whole and cut short; on one thread too."""
    torch.manual_seed(rows + intermediate)
    weight = torch.randn(2 * intermediate, 96) * 0.05  # gate over up
    x = torch.randn(rows, 96).bfloat16()
    if weights == "bfloat16":
        pairs = pairs_of(weight.bfloat16())
        products, gated = kernel(x, pairs), kernels.pair_matmul_silu(x, pairs)
    else:
        packed = Int8Weight.pack(weight, ConversionBuffer(), by_pairs=True)
        products = kernels.int8_pair_matmul(x, packed.pairs, packed.scales)
        gated = kernels.int8_pair_matmul_silu(x, packed.pairs, packed.scales)
    assert gated.shape == (rows, intermediate)
    assert torch.equal(gated, kernels.silu_mul(products))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        again = (kernels.pair_matmul_silu(x, pairs) if weights == "bfloat16" else
                 kernels.int8_pair_matmul_silu(x, packed.pairs, packed.scales))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(again, gated)


def test_the_gated_kernel_needs_gate_and_up_in_whole_groups(kernel, kernels):
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match=r"N / 16 even"):
        kernels.pair_matmul_silu(x, pairs_of(torch.randn(48, 64).bfloat16()))
    assert kernels.pair_matmul_silu(x[:0], pairs_of(torch.randn(32, 64).bfloat16())).shape == (
        0, 16)


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


def test_the_int8_kernel_rejects_arguments_that_do_not_fit(kernel, kernels):
    packed = Int8Weight.pack(torch.randn(32, 64), ConversionBuffer(), by_pairs=True)
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="pairs must be Char"):
        kernels.int8_pair_matmul(x, pairs_of(torch.randn(32, 64).bfloat16()), packed.scales)
    with pytest.raises(RuntimeError, match=r"scales must be a contiguous \(N,\) float32"):
        kernels.int8_pair_matmul(x, packed.pairs, packed.scales[:16])
    with pytest.raises(RuntimeError, match=r"scales must be a contiguous \(N,\) float32"):
        kernels.int8_pair_matmul(x, packed.pairs, packed.kernel_scales)


def test_it_serves_where_amx_does_not_run_onednn(kernel):
    """With the kernels on, on a CPU without AMX (oneDNN's own kernels run on its tiles)."""
    assert fused_ops.pair_kernels_pay() == ("amx_bf16" not in fused_ops._cpu_flags())
    fused_ops.disable()
    try:
        assert not fused_ops.pair_kernels_pay()
    finally:
        fused_ops.enable()
