"""The GGUF block kernels (quantized_matmul.cpp): ``quantized_matmul`` equals gguf's
decoding followed by a float32 matmul to float32 rounding for every served type (bfloat16
rows on AVX-512 BF16 dot products too, quantized_matmul_bf16.cpp, taken where the CPU has them),
``dequantize_blocks`` decodes as ``block_formats.dequantize_rows`` does, and both refuse
what does not fit."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from fused_kernels import build_alone
from quantized_cases import random_blocks, reference

from radixlm.kernels.cpu_ops import fused_ops
from radixlm.kernels.quantized.block_formats import NATIVE_TYPES, QType, dequantize_rows

TYPES = sorted(NATIVE_TYPES)
# Builds of quantized_matmul.cpp alone for other CPUs this one may run: the host flags each
# needs and its compiler flags (AVX2's 8 lanes; the portable lanes without intrinsics).
OTHER_BUILDS = {
    "avx2": ({"avx2", "fma", "f16c"},
             ["-march=haswell", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]),
    "default": (set(), ["-march=x86-64", "-DCPU_CAPABILITY=DEFAULT"]),
}
BINDINGS = """
#include <torch/extension.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantized_matmul", torch::wrap_pybind_function(quantized_matmul), "quantized_matmul");
  m.def("dequantize_blocks", torch::wrap_pybind_function(dequantize_blocks),
        "dequantize_blocks");
}
"""


def case(qtype: QType, out_features: int, blocks_per_row: int,
         seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks uint8 (out, row bytes), float64 reference weight (out, in))."""
    blocks = random_blocks(qtype, out_features, blocks_per_row, seed)
    return torch.from_numpy(blocks), torch.from_numpy(reference(blocks, qtype)).double()


def assert_product(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                   tolerance: float) -> None:
    """Within ``tolerance`` of the float64 product, relative to the sum of |x| |w| (so an
    output that cancels to near zero is held to its terms' scale)."""
    expected = x.double() @ weight.T
    magnitude = x.double().abs() @ weight.abs().T
    error = (got.double() - expected).abs()
    assert (error <= tolerance * magnitude + 1e-30).all(), float((error / magnitude).max())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 4, 16, 100])  # groups of 4 rows, a rest
def test_quantized_matmul_equals_ggufs_weight_times_x_in_float32(kernels, qtype, rows):
    """19 outputs: tiles of 8 weight rows (one row of x) or 4 (AVX-512; 3 on AVX2) and
    rows past the last whole tile; 1,536 inputs for the 32-value types, 768 for the others."""
    blocks_per_row = 48 if qtype.name.endswith("_0") or qtype.name.endswith("_1") else 3
    blocks, weight = case(qtype, 19, blocks_per_row, seed=rows + int(qtype))
    torch.manual_seed(rows)
    x = torch.randn(rows, weight.shape[1])
    got = kernels.quantized_matmul(x, blocks, int(qtype))
    assert got.dtype == torch.float32 and got.shape == (rows, 19)
    float32_matmul = x @ weight.float().T
    torch.testing.assert_close(got, float32_matmul, rtol=1e-5, atol=1e-5 * float(
        (x.abs() @ weight.abs().float().T).max()))
    assert_product(got, x, weight, tolerance=1e-6)


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 5])
def test_bfloat16_rows_come_back_in_bfloat16_within_one_rounding(kernels, qtype, rows):
    blocks, weight = case(qtype, 40, 2 if qtype == QType.Q6_K else 16, seed=rows)
    x = torch.randn(rows, weight.shape[1]).to(torch.bfloat16)
    got = kernels.quantized_matmul(x, blocks, int(qtype))
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 40)
    assert_product(got, x, weight, tolerance=2**-8)


def bfloat16_dot_rows(qtype: QType) -> int:
    """The most bfloat16 rows a pass takes on the dot products (quantized_bf16_dots_serve):
    one for the 32-value types of 4 and 5 bits, else 32."""
    return 1 if qtype in (QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1) else 32


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("in_features", [256, 640, 2048])
def test_bfloat16_passes_of_a_few_rows_are_the_exact_product_rounded_once(
        kernels, qtype, in_features):
    """Each output is the bfloat16 rounding of a value within 1e-5 of sum |x| |w| of the
    float64 product of gguf's weight and x (bfloat16, upcast exactly): the sums' float32
    rounding, then the output's one rounding to bfloat16. 21 outputs: whole tiles and a rest;
    rows of x in groups of 4 and a rest."""
    values = gguf.GGML_QUANT_SIZES[qtype][0]
    if in_features % values:
        pytest.skip(f"{qtype.name} blocks hold {values} values")
    blocks, weight = case(qtype, 21, in_features // values, seed=in_features + int(qtype))
    torch.manual_seed(in_features)
    for rows in (1, 2, 3, 4, 7, 16):
        x = torch.randn(rows, in_features).to(torch.bfloat16)
        got = kernels.quantized_matmul(x, blocks, int(qtype))
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 21)
        expected = x.double() @ weight.T
        slack = 1e-5 * (x.double().abs() @ weight.abs().T)
        low, high = (expected - slack).to(torch.bfloat16), (expected + slack).to(torch.bfloat16)
        assert ((low <= got) & (got <= high)).all(), (qtype.name, rows)


def test_bfloat16_passes_take_the_dot_products_where_the_cpu_has_them(kernels):
    """The build (-march=native) has AVX-512 BF16 where the CPU does: passes of bfloat16 rows
    up to bfloat16_dot_rows take the dot products there, and no others do."""
    has_dots = {"avx512f", "avx512bw", "avx512_bf16"} <= set(fused_ops._cpu_flags())
    for qtype in TYPES:
        for rows in (1, 2, 5, 32, 33):
            x = torch.zeros(rows, 256, dtype=torch.bfloat16)
            taken = has_dots and rows <= bfloat16_dot_rows(qtype)
            assert kernels.quantized_bf16_dots_serve(x, int(qtype)) == taken, (qtype.name, rows)
        assert not kernels.quantized_bf16_dots_serve(torch.zeros(1, 256), int(qtype))


@pytest.mark.parametrize("dtype, rows", [(torch.float32, 3), (torch.bfloat16, 1),
                                         (torch.bfloat16, 6)])
def test_stacked_parts_of_several_types_equal_each_parts_own_product(kernels, dtype, rows):
    """quantized_matmul_parts writes each part's product, as quantized_matmul computes it,
    into its columns of one output; parts must agree in their inputs."""
    parts = [case(qtype, out, 512 // gguf.GGML_QUANT_SIZES[qtype][0], seed=out)[0]
             for qtype, out in [(QType.Q4_K, 19), (QType.Q8_0, 5), (QType.Q6_K, 12)]]
    types = [int(QType.Q4_K), int(QType.Q8_0), int(QType.Q6_K)]
    x = torch.randn(rows, 512).to(dtype)
    got = kernels.quantized_matmul_parts(x, parts, types)
    each = [kernels.quantized_matmul(x, blocks, qtype) for blocks, qtype in zip(parts, types)]
    assert torch.equal(got, torch.cat(each, dim=1))
    with pytest.raises(RuntimeError, match="rows of 512 values"):
        kernels.quantized_matmul_parts(x, [parts[0], case(QType.Q8_0, 3, 4, seed=1)[0]],
                                       types[:2])
    with pytest.raises(RuntimeError, match="one type for each"):
        kernels.quantized_matmul_parts(x, parts, types[:2])


def test_enough_work_to_split_between_threads_matches_one_thread(kernels):
    """Threads split the output rows: the outputs do not depend on how many there are."""
    blocks, weight = case(QType.Q8_0, 1000, 20, seed=5)
    x = torch.randn(4, weight.shape[1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = kernels.quantized_matmul(x, blocks, int(QType.Q8_0))
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(kernels.quantized_matmul(x, blocks, int(QType.Q8_0)), alone,
                               rtol=0, atol=0)
    assert_product(alone, x, weight, tolerance=1e-6)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_blocks_decodes_as_dequantize_rows(kernels, qtype):
    blocks, _ = case(qtype, 9, 5, seed=int(qtype))
    expected = dequantize_rows(blocks, qtype)
    wide = torch.full_like(expected, float("nan"))
    kernels.dequantize_blocks(blocks, int(qtype), wide)
    np.testing.assert_array_equal(wide.numpy(), expected.numpy())
    half = torch.empty(expected.shape, dtype=torch.bfloat16)
    kernels.dequantize_blocks(blocks, int(qtype), half)
    torch.testing.assert_close(half, expected.to(torch.bfloat16), rtol=0, atol=0)


def test_arguments_that_do_not_fit_are_refused(kernels):
    blocks, weight = case(QType.Q8_0, 4, 2, seed=0)
    with pytest.raises(RuntimeError, match="not served"):
        kernels.quantized_matmul(torch.randn(1, 64), blocks, int(QType.IQ4_XS))
    with pytest.raises(RuntimeError, match="K = 64"):
        kernels.quantized_matmul(torch.randn(1, 32), blocks, int(QType.Q8_0))
    with pytest.raises(RuntimeError, match="multiple of 34"):
        kernels.quantized_matmul(torch.randn(1, 64), blocks[:, :40].contiguous(),
                                 int(QType.Q8_0))
    with pytest.raises(RuntimeError, match="out must be"):
        kernels.dequantize_blocks(blocks, int(QType.Q8_0), torch.empty(4, 32))


@pytest.fixture(scope="module", params=sorted(OTHER_BUILDS))
def other_build(request):
    """quantized_matmul.cpp alone, built for another CPU this one can run (skipped where it
    cannot, or where no compiler or ninja is found), in a directory removed afterwards."""
    yield from build_alone(request, OTHER_BUILDS, "quantized_matmul.cpp", BINDINGS,
                           also=("quantized_matmul_bf16.cpp",))


@pytest.mark.slow
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_build_for_another_cpu_decodes_and_multiplies_the_same(other_build, qtype):
    blocks, weight = case(qtype, 11, 9 if qtype.name.endswith(("_0", "_1")) else 2,
                          seed=int(qtype))
    expected = dequantize_rows(blocks, qtype)
    wide = torch.empty_like(expected)
    other_build.dequantize_blocks(blocks, int(qtype), wide)
    np.testing.assert_array_equal(wide.numpy(), expected.numpy())
    for rows in (1, 6):
        x = torch.randn(rows, weight.shape[1])
        assert_product(other_build.quantized_matmul(x, blocks, int(qtype)), x, weight,
                       tolerance=1e-6)
