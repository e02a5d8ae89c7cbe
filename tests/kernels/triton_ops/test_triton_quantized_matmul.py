"""The GGUF block Triton kernel (triton_ops/quantized_matmul.py) against gguf's decoding and
a float64 product, for every served type (on CPUs under Triton's interpreter): ragged rows
of x and of the weight (partial tiles), several blocks along K."""

from __future__ import annotations

import pytest
import torch
from kernel_device import KERNEL_DEVICE as DEVICE
from quantized_cases import random_blocks, reference

from radixlm.kernels.quantized.block_formats import NATIVE_TYPES, QType
from radixlm.kernels.triton_ops.quantized_matmul import quantized_matmul

pytestmark = pytest.mark.triton


@pytest.mark.parametrize("qtype", sorted(NATIVE_TYPES), ids=lambda t: t.name)
def test_the_kernel_multiplies_by_ggufs_weight(qtype):
    per_row = 2 if qtype.name.endswith("_K") else 3
    blocks = random_blocks(qtype, 37, per_row, seed=int(qtype))  # 37: a partial tile of 32
    weight = torch.from_numpy(reference(blocks, qtype)).double()
    x = torch.randn(5, weight.shape[1])  # 5: a partial tile of 16
    got = quantized_matmul(x.to(DEVICE), torch.from_numpy(blocks).to(DEVICE), qtype).cpu()
    assert got.dtype == torch.float32 and got.shape == (5, 37)
    expected = x.double() @ weight.T
    magnitude = x.double().abs() @ weight.abs().T
    assert ((got.double() - expected).abs() <= 1e-6 * magnitude + 1e-30).all()


def test_bfloat16_rows_come_back_in_bfloat16():
    blocks = random_blocks(QType.Q4_K, 20, 1, seed=1)
    weight = torch.from_numpy(reference(blocks, QType.Q4_K)).double()
    x = torch.randn(3, 256).to(torch.bfloat16)
    got = quantized_matmul(x.to(DEVICE), torch.from_numpy(blocks).to(DEVICE), QType.Q4_K)
    assert got.dtype == torch.bfloat16
    expected = x.double() @ weight.T
    magnitude = x.double().abs() @ weight.abs().T
    assert ((got.cpu().double() - expected).abs() <= 2**-7 * magnitude).all()


def test_blocks_that_do_not_fit_x_are_refused():
    blocks = torch.zeros(4, 34, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"x must be \(M, 32\)"):
        quantized_matmul(torch.randn(2, 64), blocks, QType.Q8_0)
    with pytest.raises(ValueError, match="not served"):
        quantized_matmul(torch.randn(2, 32), blocks, QType.IQ2_XS)
