"""GGUFBlockWeight and StackedWeight (models/layers/gguf_weight.py): every path (the
kernels' few-row product, the buffer they decode into, torch's decoding where the kernels
are off) multiplies by gguf's decoded weight; blocks are read, never written or copied; a
lookup decodes only its rows; a stack writes each part's columns."""

from __future__ import annotations

import mmap
import tempfile
import warnings

import numpy as np
import pytest
import torch
from quantized_cases import random_blocks, reference

from radixlm.kernels.cpu_ops.fused_ops import ProjectionKernel
from radixlm.kernels.quantized.block_formats import NATIVE_TYPES, QType
from radixlm.models.layers.gguf_weight import (
    GGUFBlockWeight,
    StackedWeight,
    kernel_max_rows,
    native_type,
)
from radixlm.models.layers.weight_formats import ConversionBuffer, HalfWeight


def weight_of(qtype: QType, out_features: int, blocks_per_row: int, seed: int,
              buffer: ConversionBuffer | None = None) -> tuple[GGUFBlockWeight, torch.Tensor]:
    """The packed weight and gguf's float64 decoding of it (out, in)."""
    blocks = random_blocks(qtype, out_features, blocks_per_row, seed)
    values = gguf_values(qtype) * blocks_per_row
    packed = GGUFBlockWeight(torch.from_numpy(blocks), qtype, (out_features, values), buffer)
    return packed, torch.from_numpy(reference(blocks, qtype)).double()


def gguf_values(qtype: QType) -> int:
    return 256 if qtype.name.endswith("_K") else 32


def assert_product(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                   tolerance: float) -> None:
    """Within ``tolerance`` of the float64 product, relative to the sum of |x| |w|."""
    expected = x.double() @ weight.T
    magnitude = x.double().abs() @ weight.abs().T
    error = (got.double() - expected).abs()
    assert (error <= tolerance * magnitude + 1e-30).all(), float((error / magnitude).max())


@pytest.mark.parametrize("qtype", sorted(NATIVE_TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 100])  # kernels: 1 row, 4 and a rest; buffer
def test_matmul_multiplies_by_ggufs_weight_on_every_path(qtype, rows, cpu_kernels):
    packed, weight = weight_of(qtype, 24, 2 if gguf_values(qtype) == 256 else 12, seed=rows,
                               buffer=ConversionBuffer())
    x = torch.randn(rows, weight.shape[1])
    got = packed.matmul(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 24)
    scale = float((x.abs() @ weight.abs().float().T).max())  # (an output's terms' size)
    torch.testing.assert_close(got, x @ weight.float().T, rtol=1e-5, atol=1e-5 * scale)
    assert_product(got, x, weight, tolerance=1e-6)


@pytest.mark.parametrize("rows", [2, 40])
def test_bfloat16_passes_come_back_in_bfloat16(rows, cpu_kernels):
    packed, weight = weight_of(QType.Q5_K, 32, 2, seed=rows, buffer=ConversionBuffer())
    x = torch.randn(rows, weight.shape[1]).to(torch.bfloat16)
    got = packed.matmul(x)
    assert got.dtype == torch.bfloat16
    # the buffer path rounds the weight to bfloat16 as well as the output
    assert_product(got, x, weight, tolerance=2**-7)


def test_float16_passes_take_the_buffer_in_float32(cpu_kernels):
    packed, weight = weight_of(QType.Q8_0, 8, 4, seed=1)
    x = torch.randn(2, weight.shape[1]).to(torch.float16)
    got = packed.matmul(x)
    assert got.dtype == torch.float16
    assert_product(got, x, weight, tolerance=2**-10)


def test_dequantized_and_rows_decode_as_gguf(cpu_kernels):
    packed, weight = weight_of(QType.Q6_K, 30, 2, seed=2)
    np.testing.assert_array_equal(packed.dequantized().numpy(), weight.float().numpy())
    ids = torch.tensor([7, 0, 7, 29])
    rows = packed.rows(ids)
    assert rows.dtype == torch.float32 and rows.shape == (4, 512)
    np.testing.assert_array_equal(rows.numpy(), weight.float()[ids].numpy())


def test_blocks_from_a_read_only_mapping_are_used_in_place(cpu_kernels):
    """A loader hands over a view of the file's read-only mapping: no copy (the tensor
    shares its memory) and nothing written (a write to it would fault)."""
    blocks = random_blocks(QType.Q4_0, 70, 2, seed=4)
    with tempfile.TemporaryFile() as file:
        file.write(b"\0" * 64 + blocks.tobytes())
        file.flush()
        mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        array = np.frombuffer(mapping, dtype=np.uint8, offset=64).reshape(blocks.shape)
        with warnings.catch_warnings():  # (torch warns, once a process, of read-only arrays)
            warnings.simplefilter("ignore", UserWarning)
            view = torch.from_numpy(array)
        packed = GGUFBlockWeight(view, QType.Q4_0, (70, 64), ConversionBuffer())
        assert packed.blocks.data_ptr() == view.data_ptr()
        weight = torch.from_numpy(reference(blocks, QType.Q4_0)).double()
        for rows in (1, 200):
            x = torch.randn(rows, 64)
            assert_product(packed.matmul(x), x, weight, tolerance=1e-6)
        assert packed.nbytes() == blocks.size and packed.tensors() == [packed.blocks]
        del packed, view, array
        mapping.close()


def test_a_long_pass_decodes_into_the_shared_buffer():
    buffer = ConversionBuffer()
    packed, weight = weight_of(QType.Q8_0, 16, 2, seed=6, buffer=buffer)
    rows = kernel_max_rows(torch.float32) + 1
    x = torch.randn(rows, 64)
    assert_product(packed.matmul(x), x, weight, tolerance=1e-6)
    storage = buffer._storage
    assert storage is not None and storage.numel() == 16 * 64
    packed.matmul(x)
    assert buffer._storage is storage


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tall_matrix_is_decoded_and_multiplied_by_parts(monkeypatch, dtype, cpu_kernels):
    """A long pass over a matrix of more than DECODE_CHUNK_VALUES values (an output head)
    decodes and multiplies it a part at a time: the same product, a buffer of one part."""
    import radixlm.models.layers.gguf_weight as gguf_weight

    monkeypatch.setattr(gguf_weight, "DECODE_CHUNK_VALUES", 7 * 256)  # 7 rows a part
    buffer = ConversionBuffer()
    packed, weight = weight_of(QType.Q4_K, 50, 1, seed=8, buffer=buffer)
    x = torch.randn(kernel_max_rows(dtype) + 3, 256).to(dtype)
    got = packed.matmul(x)
    assert got.dtype == dtype and got.shape == (x.shape[0], 50)
    assert_product(got.float(), x.float(), weight, tolerance=1e-6 if dtype == torch.float32
                   else 1e-2)
    assert buffer._storage.numel() == 7 * 256  # (one part: 1 block of 256 values a row)


def test_unserved_types_and_mismatched_shapes_are_refused():
    assert native_type(QType.Q4_K) and not native_type(QType.IQ2_XS)
    assert not native_type(QType.F16)
    with pytest.raises(ValueError, match="IQ2_XS is not served"):
        GGUFBlockWeight(torch.zeros(2, 74, dtype=torch.uint8), QType.IQ2_XS, (2, 256))
    with pytest.raises(ValueError, match=r"uint8 \(2, 34\)"):
        GGUFBlockWeight(torch.zeros(2, 36, dtype=torch.uint8), QType.Q8_0, (2, 32))
    with pytest.raises(ValueError, match="multiple of 256"):
        GGUFBlockWeight(torch.zeros(2, 144, dtype=torch.uint8), QType.Q4_K, (2, 100))


@pytest.mark.parametrize("rows", [1, 100])
def test_a_stack_of_parts_of_different_types_writes_each_parts_columns(rows, cpu_kernels):
    q, q_weight = weight_of(QType.Q4_K, 32, 1, seed=7)
    k, k_weight = weight_of(QType.Q8_0, 8, 8, seed=8)
    half = torch.randn(8, 256)
    v = HalfWeight.pack(half, ConversionBuffer())
    stacked = StackedWeight([q, k, v])
    assert stacked.shape == (48, 256)
    weight = torch.cat([q_weight, k_weight, half.half().double()])
    x = torch.randn(rows, 256)
    got = stacked.matmul(x)
    assert got.shape == (rows, 48)
    assert_product(got[:, :40], x, weight[:40], tolerance=1e-6)
    assert_product(got[:, 40:], x, weight[40:], tolerance=2**-10)  # half rounds x there
    np.testing.assert_array_equal(stacked.dequantized().numpy(), weight.float().numpy())
    assert stacked.nbytes() == q.nbytes() + k.nbytes() + v.nbytes()
    assert stacked.tensors() == [q.blocks, k.blocks, v.weight]
    assert stacked.fused_projection(1, torch.float32) is None


@pytest.mark.parametrize("rows, dtype", [(1, torch.float32), (1, torch.bfloat16),
                                         (100, torch.float32), (100, torch.bfloat16)])
def test_a_stack_of_gguf_parts_multiplies_them_together(rows, dtype, cpu_kernels):
    """GGUF parts of several types: a pass on the kernels is one call of theirs
    (``quantized_matmul_parts``), a longer one decodes them side by side into the shared
    buffer for one GEMM; the fused decode layer gets every part's blocks."""
    buffer = ConversionBuffer()
    q, q_weight = weight_of(QType.Q4_K, 32, 1, seed=7, buffer=buffer)
    k, k_weight = weight_of(QType.Q8_0, 8, 8, seed=8, buffer=buffer)
    v, v_weight = weight_of(QType.Q6_K, 8, 1, seed=9, buffer=buffer)
    stacked = StackedWeight([q, k, v])
    weight = torch.cat([q_weight, k_weight, v_weight])
    x = torch.randn(rows, 256).to(dtype)
    got = stacked.matmul(x)
    assert got.dtype == dtype and got.shape == (rows, 48)
    assert_product(got.float(), x.float(), weight,
                   tolerance=1e-6 if dtype == torch.float32 else 2**-7)
    if dtype == torch.float32:  # as the parts one by one compute it, to float32 rounding
        torch.testing.assert_close(got, torch.cat([p.matmul(x) for p in (q, k, v)], dim=1))
    product = stacked.fused_projection(1, dtype)
    assert product.kernel is ProjectionKernel.GGUF
    assert product.parts == (q.blocks, k.blocks, v.blocks)
    assert product.scales.tolist() == [[int(QType.Q4_K), 0], [int(QType.Q8_0), 1],
                                       [int(QType.Q6_K), 2]]
    assert stacked.fused_projection(kernel_max_rows(dtype) + 1, dtype) is None

