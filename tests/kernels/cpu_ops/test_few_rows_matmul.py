"""The few-rows matmuls (few_rows_matmul.cpp: ``int8_matmul`` and ``dense_matmul``) compute
float64's product to the output's rounding, reject what does not fit, and give a row the
same products whatever rows are computed beside it, also when built for CPUs other than this
one that this one can run (AVX2 only; AVX-512 without FP16, as a Zen 4 is)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fused_kernels import build_alone

TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5),
             torch.bfloat16: dict(atol=2e-2, rtol=1e-2)}  # one bfloat16 step
WEIGHT_TYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8]
# Builds for other CPUs: the host flags each needs, and its compiler flags. GCC 12 has no
# -march=znver4, so both take Haswell's instructions with Zen 3's tuning, under which GCC fused
# the multiply-adds of some tile shapes and not others: the old kernel failed this rule for
# float32 weights in the AVX2 build and float16 weights in the AVX-512 build (which lacks
# AVX-512 FP16, as a Zen 4 does), and passed it in an Intel CPU's -march=native build.
ZEN_TUNED = ["-march=haswell", "-mtune=znver3"]
OTHER_BUILDS = {
    "avx2": ({"avx2", "fma", "f16c", "bmi2"},
             [*ZEN_TUNED, "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]),
    "avx512-without-fp16": (
        {"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512dq",
         "avx512_bf16"},
        [*ZEN_TUNED, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
         "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 5, 16])  # one tile of x's rows; several, and a rest
@pytest.mark.parametrize("out_features, in_features", [
    (96, 64),  # whole tiles of weight rows and whole vectors
    (13, 70),  # rows past the last whole tile; a scalar tail after the vectors
    (3, 5),  # fewer inputs than one vector
    (1024, 576),  # enough work to split between the threads
])
def test_int8_matmul_multiplies_by_the_scaled_integers(kernels, dtype, rows, out_features,
                                                       in_features):
    """float64's product of x as stored and the dequantized weight; the error is the output's
    rounding to x's type plus float32 sums: within one step of the dtype of the sum of
    |x| |w| (float32: K steps of 2^-24 at worst; seen ~1e-7)."""
    torch.manual_seed(rows * out_features + in_features)
    weight = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8)
    scales = torch.rand(out_features) / 100
    x = torch.randn(rows, in_features).to(dtype)
    got = kernels.int8_matmul(x, weight, scales)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    dequantized = weight.double() * scales.double()[:, None]
    expected = x.double() @ dequantized.T
    magnitude = x.double().abs() @ dequantized.abs().T
    step = {torch.float32: 1e-6, torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
    assert ((got.double() - expected).abs() <= step * magnitude + 1e-30).all()
    strided = torch.randn(rows, 2 * in_features).to(dtype)[:, ::2]  # not contiguous
    assert torch.equal(kernels.int8_matmul(strided, weight, scales),
                       kernels.int8_matmul(strided.contiguous(), weight, scales))
    assert kernels.int8_matmul(x[:0], weight, scales).shape == (0, out_features)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 5, 7])  # 7: a whole tile of 4 rows and one of 3
@pytest.mark.parametrize("out_features, in_features", [(96, 64), (13, 70), (1024, 576)])
def test_dense_matmul_computes_what_f_linear_computes(kernels, dtype, rows, out_features,
                                                      in_features):
    """Weights of x's own type, float32 sums: float64's product to one step of the dtype
    (of the sum of |x| |w|), and F.linear's to one rounding step of the output."""
    torch.manual_seed(rows + out_features)
    weight = (torch.randn(out_features, in_features) * 0.05).to(dtype)
    x = torch.randn(rows, 2 * in_features).to(dtype)[:, ::2]  # a strided view
    got = kernels.dense_matmul(x, weight)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    expected = x.double() @ weight.double().T
    magnitude = x.double().abs() @ weight.double().abs().T
    step = {torch.float32: 1e-6, torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
    assert ((got.double() - expected).abs() <= step * magnitude + 1e-30).all()
    torch.testing.assert_close(got, F.linear(x, weight), **TOLERANCE.get(
        dtype, dict(atol=1e-3, rtol=1e-3)))
    for narrow in (torch.float16, torch.bfloat16):  # 16-bit weights beside any activations
        stored = weight.to(narrow)  # (fp16wo; dtype=auto's storage on float32 CPUs)
        got = kernels.dense_matmul(x, stored)
        assert got.dtype == dtype
        expected = x.double() @ stored.double().T
        magnitude = x.double().abs() @ stored.double().abs().T
        assert ((got.double() - expected).abs() <= step * magnitude + 1e-30).all()
    wrong = torch.float64 if dtype == torch.float32 else torch.float32
    with pytest.raises(RuntimeError, match="of x's dtype, float16 or bfloat16"):
        kernels.dense_matmul(x, weight.to(wrong))


def check_rows_do_not_change_products(module, weight_type: torch.dtype) -> None:
    """A row's products do not depend on the rows beside it: alone (the one-row tiles), in a
    whole tile of 4 or in the rest after the tiles, bit for bit. K = 77 leaves columns past
    the last whole vector on AVX2 (8 lanes) and AVX-512 (16), where a scalar loop once
    rounded by the tile's shape."""
    torch.manual_seed(3)
    x = torch.randn(39, 77)
    if weight_type == torch.int8:
        weight, scales = torch.randint(-127, 128, (52, 77), dtype=torch.int8), torch.rand(52)
        product = lambda rows: module.int8_matmul(rows, weight, scales)  # noqa: E731
        dequantized = weight.double() * scales.double()[:, None]
    else:
        weight = torch.randn(52, 77).to(weight_type)
        product = lambda rows: module.dense_matmul(rows, weight)  # noqa: E731
        dequantized = weight.double()
    whole = product(x)
    magnitude = x.double().abs() @ dequantized.abs().T  # float32 sums: within 1e-6 of it
    assert ((whole.double() - x.double() @ dequantized.T).abs() <= 1e-6 * magnitude).all()
    for first, count in [(0, 1), (38, 1), (5, 3), (8, 4), (2, 7), (0, 39)]:
        assert torch.equal(product(x[first:first + count]), whole[first:first + count]), \
            (first, count)


@pytest.mark.parametrize("weight_type", WEIGHT_TYPES)
def test_few_rows_matmul_gives_a_row_the_same_products_in_any_pass(kernels, weight_type):
    check_rows_do_not_change_products(kernels, weight_type)


# The two kernels' module, without the others.
FEW_ROWS_BINDINGS = """
#include <torch/extension.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_matmul", torch::wrap_pybind_function(int8_matmul), "int8_matmul");
  m.def("dense_matmul", torch::wrap_pybind_function(dense_matmul), "dense_matmul");
}
"""


@pytest.fixture(scope="module", params=sorted(OTHER_BUILDS))
def other_build(request):
    """few_rows_matmul.cpp alone, built for another CPU this one can run (skipped where it
    cannot, or where no compiler or ninja is found), in a directory removed afterwards."""
    yield from build_alone(request, OTHER_BUILDS, "few_rows_matmul.cpp", FEW_ROWS_BINDINGS)


@pytest.mark.slow
@pytest.mark.parametrize("weight_type", WEIGHT_TYPES)
def test_a_build_for_another_cpu_gives_a_row_the_same_products_in_any_pass(other_build,
                                                                             weight_type):
    check_rows_do_not_change_products(other_build, weight_type)


def test_int8_matmul_rejects_arguments_that_do_not_fit(kernels):
    weight, scales, x = torch.ones(8, 16, dtype=torch.int8), torch.ones(8), torch.randn(2, 16)
    with pytest.raises(RuntimeError, match=r"x must be \(M, K\)"):
        kernels.int8_matmul(torch.randn(2, 15), weight, scales)
    with pytest.raises(RuntimeError, match=r"scales must be \(N,\) float32"):
        kernels.int8_matmul(x, weight, torch.ones(7))
    with pytest.raises(RuntimeError, match=r"scales must be \(N,\) float32"):
        kernels.int8_matmul(x, weight, scales.double())
    with pytest.raises(RuntimeError, match="weight must be int8"):
        kernels.int8_matmul(x, weight.float(), scales)
    with pytest.raises(RuntimeError, match=r"contiguous \(N, K\)"):
        kernels.int8_matmul(x, torch.ones(16, 8, dtype=torch.int8).T, scales)
    with pytest.raises(RuntimeError, match="int8_matmul"):  # no double activations
        kernels.int8_matmul(x.double(), weight, scales)
