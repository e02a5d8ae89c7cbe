"""block_formats.dequantize_rows decodes every served GGUF type bit for bit as
``gguf.quants.dequantize`` does: on blocks gguf's own quantizer made where it has one, on
random bytes with sane (finite, small) scales for the K types, which gguf only decodes; and
Q8_K, which gguf does neither, against llama.cpp's ``d * q`` written here from its layout."""

from __future__ import annotations

import gguf
import gguf.quants
import numpy as np
import pytest
import torch
from quantized_cases import QUANTIZED_BY_GGUF, random_blocks, reference

from radixlm.kernels.quantized.block_formats import (
    NATIVE_TYPES,
    BlockGeometry,
    QType,
    dequantize_rows,
    geometry,
    row_bytes,
)


def test_native_types_are_the_listed_block_formats_with_ggufs_geometry():
    assert {t.name for t in NATIVE_TYPES} == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                                              "Q4_K", "Q5_K", "Q6_K", "Q8_K"}
    for qtype in NATIVE_TYPES:
        assert geometry(qtype) == BlockGeometry(*gguf.GGML_QUANT_SIZES[qtype])


def test_gguf_quantizes_exactly_the_32_value_types():
    """Which reference each type is tested against: a type gguf learns to quantize should
    move into QUANTIZED_BY_GGUF."""
    for qtype in NATIVE_TYPES:
        data = np.zeros((1, gguf.GGML_QUANT_SIZES[qtype][0]), dtype=np.float32)
        try:
            gguf.quants.quantize(data, qtype)
            quantizes = True
        except NotImplementedError:
            quantizes = False
        assert quantizes == (qtype in QUANTIZED_BY_GGUF), qtype.name


@pytest.mark.parametrize("qtype", sorted(NATIVE_TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("rows, blocks_per_row", [(1, 1), (7, 3), (64, 8)])
def test_dequantize_rows_equals_gguf_bit_for_bit(qtype, rows, blocks_per_row):
    blocks = random_blocks(qtype, rows, blocks_per_row, seed=rows * 31 + blocks_per_row)
    got = dequantize_rows(torch.from_numpy(blocks), qtype)
    expected = reference(blocks, qtype)
    assert got.dtype == torch.float32
    assert got.shape == (rows, blocks_per_row * geometry(qtype).values)
    assert np.isfinite(expected).all()
    np.testing.assert_array_equal(got.numpy(), expected)


def test_dequantize_rows_reads_a_strided_view_of_the_rows():
    """A view of some rows (a loader's slice of a memory-mapped tensor) decodes as a copy."""
    blocks = torch.from_numpy(random_blocks(QType.Q4_K, 10, 2, seed=3))
    view = blocks[2:8:2]
    np.testing.assert_array_equal(dequantize_rows(view, QType.Q4_K).numpy(),
                                  reference(view.contiguous().numpy(), QType.Q4_K))


def test_unserved_types_and_ragged_rows_are_refused():
    with pytest.raises(ValueError, match="IQ4_XS is not served"):
        geometry(QType.IQ4_XS)
    with pytest.raises(ValueError, match="multiple of 32"):
        row_bytes(QType.Q8_0, 48)
    assert row_bytes(QType.Q6_K, 512) == 2 * 210
    with pytest.raises(ValueError, match="uint8"):
        dequantize_rows(torch.zeros(2, 35, dtype=torch.uint8), QType.Q8_0)
