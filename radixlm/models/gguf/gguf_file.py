"""Opening a GGUF file (llama.cpp's format) and checking it before anything is built from it.

``gguf_header.read_gguf`` parses the file's metadata and tensor table and memory-maps its
tensors (the ``gguf`` package's records and types; its ``GGUFReader`` took seconds on a
large vocabulary's metadata); this module turns whatever that raises into one
``ValueError`` that names the file and what is wrong (not a GGUF, truncated, a tensor of a
type the package does not know), and checks what the parser does not: every tensor's bytes
lie inside the file, and its bytes are what its type and shape imply. Nothing here writes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from radixlm.models.gguf.gguf_header import read_gguf


def open_reader(path: Path):
    """``read_gguf(path)`` with its tensors checked (``check_tensors``); a missing file is
    ``FileNotFoundError``, anything unreadable a ``ValueError`` naming it."""
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    try:
        reader = read_gguf(path)
    except Exception as err:  # the reader raises ValueError, IndexError, struct/OS errors
        raise ValueError(f"{str(path)!r} is not a readable GGUF file: {_reason(err, path)}"
                         ) from None
    check_tensors(reader, path)
    return reader


def _reason(err: Exception, path: Path) -> str:
    """What a parse failure means, in the user's terms."""
    text = str(err)
    if "GGMLQuantizationType" in text:
        return f"a tensor has a type this version of gguf does not know ({text})"
    if "cannot reshape" in text or "out of bounds" in text or "too small" in text:
        return f"the file is truncated or its tensor table is corrupt ({text})"
    return text or type(err).__name__


def check_tensors(reader, path: Path) -> None:
    """Raises ``ValueError`` naming the file and tensor when a tensor's bytes run past the
    end of the file or disagree in size with its type and shape."""
    import gguf

    size = path.stat().st_size
    for tensor in reader.tensors:
        block, type_bytes = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        elements = int(np.prod([int(d) for d in tensor.shape]))
        if elements % block:
            raise ValueError(
                f"GGUF file {str(path)!r}: tensor {tensor.name!r} has {elements} values, not "
                f"a whole number of {tensor.tensor_type.name} blocks of {block}")
        expected = elements // block * type_bytes
        if tensor.data_offset + expected > size:
            raise ValueError(
                f"GGUF file {str(path)!r} is truncated: tensor {tensor.name!r} ends at byte "
                f"{tensor.data_offset + expected}, the file has {size}")
        if tensor.data.nbytes != expected:
            raise ValueError(
                f"GGUF file {str(path)!r}: tensor {tensor.name!r} holds {tensor.data.nbytes} "
                f"bytes, its type and shape need {expected}")


class Metadata:
    """Typed access to a GGUF's scalar metadata keys, with errors that name the file and key."""

    def __init__(self, reader, path: Path) -> None:
        self._reader = reader
        self.path = path

    def get(self, key: str, default=None):
        field = self._reader.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise ValueError(f"GGUF file {str(self.path)!r} lacks the metadata key {key!r}")
        return value

    def has(self, key: str) -> bool:
        return key in self._reader.fields


def clean_float(value: float) -> float:
    """A float32 metadata value as its shortest decimal (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def matrix_shape(tensor) -> tuple[int, ...]:
    """A GGUF tensor's shape in PyTorch order (ggml lists dims fastest first): a matrix is
    (rows, columns) = (out, in)."""
    return tuple(int(d) for d in reversed(tensor.shape))
