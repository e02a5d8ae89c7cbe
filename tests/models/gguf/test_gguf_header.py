"""``read_gguf`` against the ``gguf`` package's own ``GGUFReader`` on the same files: every
metadata value's ``contents()`` and every tensor's record and bytes, on a file written
with ``gguf``'s writer (every value type, arrays of each, a custom alignment, float and
block-quantized tensors) and on the public gemma-3 file; damaged files fail with a
``ValueError`` saying what is wrong, wherever they are cut."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from radixlm.models.gguf.gguf_header import GGUFHeader, read_gguf

SCALARS = {  # key -> (value, gguf.GGUFValueType)
    "u8": (200, gguf.GGUFValueType.UINT8), "i8": (-100, gguf.GGUFValueType.INT8),
    "u16": (60000, gguf.GGUFValueType.UINT16), "i16": (-30000, gguf.GGUFValueType.INT16),
    "u32": (4_000_000_000, gguf.GGUFValueType.UINT32),
    "i32": (-2_000_000_000, gguf.GGUFValueType.INT32),
    "f32": (1e-5, gguf.GGUFValueType.FLOAT32), "bool": (True, gguf.GGUFValueType.BOOL),
    "u64": (2**63 + 5, gguf.GGUFValueType.UINT64), "i64": (-(2**62), gguf.GGUFValueType.INT64),
    "f64": (3.141592653589793, gguf.GGUFValueType.FLOAT64),
    "text": ("héllo ✓", gguf.GGUFValueType.STRING),
}
ARRAYS = {  # key -> (values, item type)
    "tokens": (["<s>", "", "Ġthe", "日本", "a b"] * 50, gguf.GGUFValueType.STRING),
    "scores": ([0.5, -1.25, 3.0e-7] * 40, gguf.GGUFValueType.FLOAT32),
    "types": ([1, 3, 6, -2] * 30, gguf.GGUFValueType.INT32),
    "flags": ([True, False, False], gguf.GGUFValueType.BOOL),
    "big": ([2**40, 7], gguf.GGUFValueType.UINT64),
    "wide": ([1.5, -2.25e-300], gguf.GGUFValueType.FLOAT64),
    "bytes": ([0, 255, 17], gguf.GGUFValueType.UINT8),
}


def write_every_kind(path, alignment: int = 64,
                     endianess: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE) -> None:
    rng = np.random.default_rng(5)
    writer = gguf.GGUFWriter(path, "llama", endianess=endianess)
    writer.add_custom_alignment(alignment)
    for key, (value, value_type) in SCALARS.items():
        writer.add_key_value(f"test.{key}", value, value_type)
    for key, (values, item_type) in ARRAYS.items():
        writer.add_key_value(f"test.{key}", values, gguf.GGUFValueType.ARRAY, sub_type=item_type)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 4, 8)).astype(np.float16))
    writer.add_tensor("i32", np.arange(7, dtype=np.int32))
    for qtype, shape in ((gguf.GGMLQuantizationType.Q8_0, (4, 64)),
                         (gguf.GGMLQuantizationType.Q4_0, (3, 32))):
        values = rng.standard_normal(shape).astype(np.float32)
        writer.add_tensor(qtype.name.lower(), gguf.quants.quantize(values, qtype),
                          raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def assert_reads_alike(path) -> None:
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    assert isinstance(ours, GGUFHeader)
    assert list(ours.fields) == [k for k in theirs.fields if not k.startswith("GGUF.")]
    for key, field in ours.fields.items():
        assert field.contents() == theirs.fields[key].contents(), key
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (
            b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset)
        assert np.array_equal(a.shape, b.shape) and a.shape.dtype == b.shape.dtype
        assert (a.data.shape, a.data.dtype) == (b.data.shape, b.data.dtype), a.name
        assert np.array_equal(a.data, b.data, equal_nan=True), a.name


@pytest.mark.parametrize("alignment", [32, 64])
def test_every_value_type_and_tensor_reads_as_gguf_reads_it(tmp_path, alignment):
    path = tmp_path / "every.gguf"
    write_every_kind(path, alignment)
    assert_reads_alike(path)
    fields = read_gguf(path).fields
    assert fields["test.text"].contents() == "héllo ✓"
    assert fields["test.tokens"].contents()[:4] == ["<s>", "", "Ġthe", "日本"]
    assert fields["general.alignment"].contents() == alignment


def test_a_file_cut_anywhere_is_a_value_error_saying_so(tmp_path):
    path = tmp_path / "every.gguf"
    write_every_kind(path)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    for end in sorted({*range(1, 400, 37), *range(400, len(data), len(data) // 25)}):
        cut.write_bytes(data[:end])
        with pytest.raises(ValueError, match="truncated|magic|empty"):
            read_gguf(cut)


def every_kind_with(tmp_path, after: bytes, was: int, value: int):
    """The file of ``write_every_kind`` with the uint32 right after ``after`` (which must be
    ``was``) set to ``value``."""
    path = tmp_path / "every.gguf"
    write_every_kind(path)
    data = bytearray(path.read_bytes())
    at = data.index(after) + len(after)
    assert int.from_bytes(data[at:at + 4], "little") == was
    data[at:at + 4] = value.to_bytes(4, "little")
    path.write_bytes(bytes(data))
    return path


def test_an_unknown_value_type_is_named(tmp_path):
    path = every_kind_with(tmp_path, b"test.u8", int(gguf.GGUFValueType.UINT8), 77)
    with pytest.raises(ValueError, match="unknown GGUF value type 77"):
        read_gguf(path)


def test_a_tensor_of_too_many_dimensions_is_refused(tmp_path):
    name = (3).to_bytes(8, "little") + b"f16"  # a tensor info's name, then its dims count
    path = every_kind_with(tmp_path, name, 3, 1000)
    with pytest.raises(ValueError, match="'f16' has 1000 dimensions"):
        read_gguf(path)


def test_an_alignment_that_is_no_positive_uint32_is_refused(tmp_path):
    path = every_kind_with(tmp_path, b"general.alignment", int(gguf.GGUFValueType.UINT32),
                           int(gguf.GGUFValueType.INT32))
    with pytest.raises(ValueError, match="bad general.alignment"):
        read_gguf(path)


def test_a_big_endian_file_is_left_to_gguf_s_reader(tmp_path):
    path = tmp_path / "big.gguf"
    write_every_kind(path, endianess=gguf.GGUFEndian.BIG)
    reader = read_gguf(path)
    assert isinstance(reader, gguf.GGUFReader)
    assert reader.fields["test.i32"].contents() == SCALARS["i32"][0]


@pytest.mark.slow  # the gemma-3 file (253 MB): 262,144 tokens, 514,906 merges
def test_the_gemma3_file_reads_as_gguf_reads_it():
    from gemma3_file import gemma3_gguf

    assert_reads_alike(gemma3_gguf())
