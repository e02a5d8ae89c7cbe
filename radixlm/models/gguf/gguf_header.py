"""A GGUF file's metadata and tensor table, read without parsing what is not asked for.

``gguf.GGUFReader`` builds a NumPy view for every element of every metadata array as it
opens a file: for a vocabulary of 262,144 tokens that is over a million views and seconds
of every scheduler start, although loading weights reads no tokenizer metadata
(benchmarks/RESULTS.md). ``read_gguf`` walks the same layout (llama.cpp's ``gguf.md``:
header, key/value pairs, tensor infos, aligned data) with ``struct`` over the memory-mapped
file, skipping an array's elements by their lengths, and decodes a value only when its
``contents()`` is asked for. Its ``tensors`` are the ``gguf`` package's own
``ReaderTensor`` records with the views ``GGUFReader`` gives (the block bytes of a quantized
tensor, the values of a float one), and ``contents()`` returns what ``GGUFReader``'s fields
return (``tests/models/gguf/test_gguf_header.py`` compares the two on written files and on
the gemma-3 file). Little-endian files only (llama.cpp writes those); a big-endian one is
read by ``GGUFReader``.

Invariant: nothing is read past the file's end; a length or count that would is a
``ValueError`` saying the file is truncated, and an unknown value or tensor type a
``ValueError`` naming it.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 8  # (ggml's tensors have at most 4)
_SCALARS = {  # gguf.GGUFValueType's numbers -> struct format (little-endian)
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
    10: "<Q", 11: "<q", 12: "<d",
}
_UINT32, _STRING, _ARRAY = 4, 8, 9
_FLOAT_TENSORS = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
                  "I16": np.int16, "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True, eq=False)
class HeaderField:
    """One metadata value: its type (and an array's item type and length) and where it
    starts; ``contents()`` decodes it."""

    value_type: int
    item_type: int | None
    count: int
    offset: int
    data: np.ndarray  # the file's bytes (the reader's memory map)

    def contents(self) -> Any:
        """The value as ``GGUFReader``'s ``ReaderField.contents()`` gives it: a number, a
        bool, a str, or a list of them (an array of arrays: one flat list)."""
        if self.value_type == _ARRAY and self.item_type in _SCALARS:
            dtype = np.dtype(_SCALARS[self.item_type])
            return np.frombuffer(self.data, dtype, self.count, self.offset).tolist()
        view = memoryview(self.data)
        try:
            if self.value_type != _ARRAY:
                return _decode(view, self.offset, self.value_type)[0]
            values, offset = [], self.offset
            for _ in range(self.count):
                value, offset = _decode(view, offset, self.item_type)
                values.extend(value) if isinstance(value, list) else values.append(value)
            return values
        finally:
            view.release()


class GGUFHeader:
    """``fields`` (key -> ``HeaderField``, in file order) and ``tensors``
    (``gguf.ReaderTensor``, in file order) of the GGUF file at ``path``."""

    def __init__(self, path: str | Path):
        import gguf

        self.data = np.memmap(path, mode="r")
        view = memoryview(self.data)
        try:
            if bytes(view[:4]) != GGUF_MAGIC:
                raise ValueError("GGUF magic invalid")
            version, tensor_count, kv_count = _unpack(view, 4, "<IQQ")
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} is not one this reader handles")
            offset = 24
            self.fields: dict[str, HeaderField] = {}
            for _ in range(kv_count):
                key, offset = _string(view, offset)
                (value_type,) = _unpack(view, offset, "<I")
                field, offset = _field(view, self.data, offset + 4, value_type)
                self.fields[key] = field
            infos = []
            for _ in range(tensor_count):
                name, offset = _string(view, offset)
                (dims_count,) = _unpack(view, offset, "<I")
                if dims_count > MAX_DIMS:
                    raise ValueError(f"tensor {name!r} has {dims_count} dimensions")
                dims = _unpack(view, offset + 4, f"<{dims_count}Q")
                raw_type, relative = _unpack(view, offset + 4 + 8 * dims_count, "<IQ")
                offset += 4 + 8 * dims_count + 12
                infos.append((name, dims, gguf.GGMLQuantizationType(raw_type), relative))
        finally:
            view.release()
        alignment = DEFAULT_ALIGNMENT
        if "general.alignment" in self.fields:
            field = self.fields["general.alignment"]
            alignment = field.contents() if field.value_type == _UINT32 else 0
            if alignment <= 0:
                raise ValueError("bad general.alignment field (a positive uint32 expected)")
        start = -(-offset // alignment) * alignment
        self.tensors = [self._tensor(gguf, start, *info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("duplicated tensor names in the tensor table")

    def _tensor(self, gguf, start: int, name: str, dims: tuple[int, ...], ggml_type,
                relative: int):
        """The ``ReaderTensor`` ``GGUFReader`` builds for one tensor info."""
        elements = math.prod(dims)  # (1 for a scalar, as GGUFReader has it)
        if elements > len(self.data) * 8:  # (no type stores a value in under a bit)
            raise ValueError(f"the file is truncated: tensor {name!r} has {elements} values")
        block, type_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
        n_bytes = elements * type_bytes // block
        offset = start + relative
        if offset + n_bytes > len(self.data):
            raise ValueError(f"the file is truncated: tensor {name!r} ends at byte "
                             f"{offset + n_bytes}, the file has {len(self.data)}")
        shape = tuple(reversed(dims))
        item = _FLOAT_TENSORS.get(ggml_type.name)
        if item is None:
            item, count = np.uint8, n_bytes
            shape = gguf.quants.quant_shape_to_byte_shape(shape, ggml_type)
        else:
            count = elements
        values = self.data[offset:offset + count * np.dtype(item).itemsize].view(item)
        return gguf.ReaderTensor(
            name=name, tensor_type=ggml_type, shape=np.array(dims, dtype=np.uint64),
            n_elements=elements, n_bytes=n_bytes, data_offset=offset,
            data=values.reshape(shape), field=None)


def read_gguf(path: str | Path):
    """The metadata and tensor table of the GGUF at ``path``: a ``GGUFHeader``, or, for a
    big-endian file, ``gguf.GGUFReader``'s (the same ``fields[key].contents()`` and
    ``tensors``)."""
    with open(path, "rb") as file:
        head = file.read(8)
    if len(head) == 8 and head[:4] == GGUF_MAGIC and int.from_bytes(head[4:], "little") > 65535:
        import gguf

        return gguf.GGUFReader(path)  # the version's bytes swapped: a big-endian file
    return GGUFHeader(path)


def _unpack(view: memoryview, offset: int, layout: str) -> tuple:
    if offset + struct.calcsize(layout) > len(view):
        raise ValueError(f"the file is truncated: its header runs past byte {len(view)}")
    return struct.unpack_from(layout, view, offset)


def _string_end(view: memoryview, offset: int) -> int:
    """The offset past the string (a uint64 length, then its bytes) at ``offset``."""
    (length,) = _unpack(view, offset, "<Q")
    end = offset + 8 + length
    if end > len(view):
        raise ValueError(f"the file is truncated: a string runs past byte {len(view)}")
    return end


def _string(view: memoryview, offset: int) -> tuple[str, int]:
    end = _string_end(view, offset)
    return str(view[offset + 8:end], encoding="utf-8"), end


def _field(view: memoryview, data: np.ndarray, offset: int,
           value_type: int) -> tuple[HeaderField, int]:
    """The field whose value starts at ``offset``, and the offset past it (an array's
    elements skipped by their lengths, not decoded)."""
    if value_type != _ARRAY:
        return HeaderField(value_type, None, 1, offset, data), _skip(view, offset, value_type)
    item_type, count = _unpack(view, offset, "<IQ")
    start = end = offset + 12
    if item_type in _SCALARS:
        end += count * struct.calcsize(_SCALARS[item_type])
        if end > len(view):
            raise ValueError(f"the file is truncated: an array runs past byte {len(view)}")
    else:
        for _ in range(count):
            end = _skip(view, end, item_type)
    return HeaderField(_ARRAY, item_type, count, start, data), end


def _skip(view: memoryview, offset: int, value_type: int) -> int:
    """The offset past the value of ``value_type`` at ``offset``."""
    if value_type in _SCALARS:
        _unpack(view, offset, _SCALARS[value_type])
        return offset + struct.calcsize(_SCALARS[value_type])
    if value_type == _STRING:
        return _string_end(view, offset)
    if value_type == _ARRAY:
        return _field(view, None, offset, value_type)[1]
    raise ValueError(f"unknown GGUF value type {value_type}")


def _decode(view: memoryview, offset: int, value_type: int) -> tuple[Any, int]:
    """The value of ``value_type`` at ``offset`` (an array's: a flat list), and the offset
    past it."""
    if value_type in _SCALARS:
        (value,) = _unpack(view, offset, _SCALARS[value_type])
        return value, offset + struct.calcsize(_SCALARS[value_type])
    if value_type == _STRING:
        return _string(view, offset)
    if value_type != _ARRAY:
        raise ValueError(f"unknown GGUF value type {value_type}")
    item_type, count = _unpack(view, offset, "<IQ")
    values, offset = [], offset + 12
    for _ in range(count):
        value, offset = _decode(view, offset, item_type)
        values.extend(value) if isinstance(value, list) else values.append(value)
    return values, offset
