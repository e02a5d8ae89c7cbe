"""The disk tier's file format: a block's identity, key and checksum, and its header.

A block file is safetensors (never a pickle): one uint8 tensor ``payload``, the bytes of
every per-slot buffer of the pool one after another (``layer_buffers()`` order, each
(block_tokens, *slot_shape) of the pool's dtype: ``pack_payload``), and string metadata
naming the format and its version, the writer's ``StoreIdentity``, the block's key and
tokens, and a checksum of the payload (version 1 stored a tensor a buffer). Keys chain over
whole prefixes (``chained_block_keys``, see ``disk_kv_store.py``), so a key names one
content under one identity; everything here is pure (no I/O), shared by the store and the
tiers above it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import struct
from collections.abc import Sequence

import torch

FORMAT_NAME = "radixlm-kv-block"
FORMAT_VERSION = "2"
KEY_PATTERN = re.compile(r"[0-9a-f]{64}")


def _digest(*parts: bytes) -> hashlib.blake2b:
    h = hashlib.blake2b(digest_size=32)
    for part in parts:
        h.update(struct.pack("<Q", len(part)))  # length-prefixed: no two part lists collide
        h.update(part)
    return h


@dataclasses.dataclass(frozen=True, slots=True)
class StoreIdentity:
    """What a block's bytes depend on; a store never uses blocks of another identity.

    ``dtype`` is a torch dtype name ("bfloat16"); ``buffer_shapes`` holds one per-slot shape
    per buffer of the pool, in ``layer_buffers()`` order; ``tokenizer`` is any string that
    changes when the token ids would (a hash of tokenizer.json, say).
    """

    model: str
    dtype: str
    page_size: int
    block_tokens: int
    buffer_shapes: tuple[tuple[int, ...], ...]
    tokenizer: str
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"dtype must name a torch dtype ('bfloat16'), got {self.dtype!r}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.block_tokens < 1 or self.block_tokens % self.page_size:
            raise ValueError(f"block_tokens must be a positive multiple of page_size "
                             f"({self.page_size}), got {self.block_tokens}")
        if not self.buffer_shapes:
            raise ValueError("buffer_shapes must list at least one buffer")
        shapes = tuple(tuple(int(d) for d in shape) for shape in self.buffer_shapes)
        if any(d < 1 for shape in shapes for d in shape):
            raise ValueError(f"buffer_shapes must be positive, got {shapes}")
        object.__setattr__(self, "buffer_shapes", shapes)
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, tp_size={self.tp_size}), got {self.tp_rank}")

    @classmethod
    def of_pool(cls, pool, *, model: str, tokenizer: str, page_size: int, block_tokens: int,
                tp_rank: int = 0, tp_size: int = 1) -> StoreIdentity:
        """The identity of blocks cut from ``pool`` (with ``dtype`` and ``layer_buffers()``)."""
        return cls(model=model, dtype=str(pool.dtype).removeprefix("torch."),
                   page_size=page_size, block_tokens=block_tokens,
                   buffer_shapes=tuple(tuple(b.shape[1:]) for b in pool.layer_buffers()),
                   tokenizer=tokenizer, tp_rank=tp_rank, tp_size=tp_size)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def canonical_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))

    def fingerprint(self) -> str:
        return _digest(self.canonical_json().encode()).hexdigest()


def chained_block_keys(fingerprint: str, block_tokens: int, tokens: Sequence[int],
                       extra_key: str | None) -> list[str]:
    """The key of every full block of ``tokens`` (see the module docstring)."""
    chain = _digest(json.dumps([fingerprint, extra_key]).encode()).digest()
    keys = []
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        block = tokens[start:start + block_tokens]
        h = _digest(chain, struct.pack(f"<{block_tokens}q", *block))
        chain = h.digest()
        keys.append(h.hexdigest())
    return keys


def payload_checksum(buffers: Sequence[torch.Tensor]) -> str:
    """A hash (SHA-256: CPUs hash it in hardware) over the raw bytes of each tensor, any
    dtype (bfloat16 included)."""
    h = hashlib.sha256()
    for t in buffers:
        raw = t.contiguous().view(torch.uint8).reshape(-1).numpy()
        h.update(struct.pack("<Q", raw.nbytes))
        h.update(raw.data)
    return h.hexdigest()


def pack_payload(buffers: Sequence[torch.Tensor]) -> torch.Tensor:
    """The raw bytes of ``buffers`` (CPU tensors, any dtype), one after another: (N,) uint8."""
    return torch.cat([t.contiguous().view(torch.uint8).reshape(-1) for t in buffers])


def unpack_payload(payload: torch.Tensor, identity: StoreIdentity) -> list[torch.Tensor]:
    """``pack_payload``'s buffers back, as views of ``payload``; ValueError if its size is
    not what ``identity``'s block holds."""
    dtype = identity.torch_dtype
    shapes = [(identity.block_tokens, *shape) for shape in identity.buffer_shapes]
    sizes = [math.prod(shape) * dtype.itemsize for shape in shapes]
    if payload.dtype != torch.uint8 or tuple(payload.shape) != (sum(sizes),):
        raise ValueError(f"a payload of {payload.dtype} {tuple(payload.shape)}, expected "
                         f"{sum(sizes)} bytes")
    return [part.view(dtype).view(shape)
            for part, shape in zip(payload.split(sizes), shapes, strict=True)]


def header_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file's bytes; ValueError if it is unreadable."""
    if len(data) < 8:
        raise ValueError("shorter than a safetensors header")
    header_len = int.from_bytes(data[:8], "little")
    if header_len > len(data) - 8:
        raise ValueError("header runs past the end of the file")
    header = json.loads(data[8:8 + header_len])
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict):
        raise ValueError("no metadata in the header")
    return metadata


class CorruptBlock(Exception):
    """A block file that failed a check; the message says which."""
