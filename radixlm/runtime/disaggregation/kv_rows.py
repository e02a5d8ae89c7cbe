"""A request's KV as raw bytes: gathered from one pool's slots, scattered into another's.

A pool is a list of per-slot buffers (``layer_buffers``: K and V per layer for multi-head
attention, the latent per layer for MLA), each (num_slots, *row_shape). Moving the KV of
T tokens is, per buffer, T rows gathered at the sender's slots and written at the
receiver's slots: the bytes are the same whatever the two sides' page sizes, so long as
their layouts (``KVLayout``) are equal. Nothing but tensor bytes crosses the wire here.
"""

from __future__ import annotations

import math
import warnings

import msgspec
import torch


class KVLayout(msgspec.Struct, frozen=True):
    """What must agree between a prefill pool and a decode pool for KV to move between them."""

    dtype: str
    row_shapes: list[list[int]]
    """Per buffer, a slot's row shape (e.g. [H_kv, D]), in ``layer_buffers`` order."""
    page_size: int

    @classmethod
    def of(cls, buffers: list[torch.Tensor], page_size: int) -> KVLayout:
        return cls(str(buffers[0].dtype).removeprefix("torch."),
                   [list(b.shape[1:]) for b in buffers], page_size)

    def bytes_per_token(self) -> int:
        size = getattr(torch, self.dtype).itemsize
        return sum(size * math.prod(shape) for shape in self.row_shapes)

    def mismatch(self, other: KVLayout) -> str | None:
        """Why KV cannot move between pools of these layouts, or None when it can."""
        if self.page_size != other.page_size:
            return f"page sizes differ: prefill {self.page_size}, decode {other.page_size}"
        if self.dtype != other.dtype:
            return f"KV dtypes differ: prefill {self.dtype}, decode {other.dtype}"
        if self.row_shapes != other.row_shapes:
            return (f"KV layouts differ (layers x heads x dims): prefill "
                    f"{len(self.row_shapes)} buffers of {self.row_shapes[0]}, decode "
                    f"{len(other.row_shapes)} buffers of {other.row_shapes[0]}")
        return None


def gather_rows(buffers: list[torch.Tensor], slots: torch.Tensor) -> list[torch.Tensor]:
    """The rows at ``slots`` (T,) of every buffer, as contiguous host tensors (T, *row)."""
    index = slots.to(buffers[0].device)
    return [b.index_select(0, index).cpu() for b in buffers]


def byte_views(rows: list[torch.Tensor]) -> list[memoryview]:
    """Each host tensor's bytes, without a copy (for a zero-copy send)."""
    return [memoryview(r.view(-1).view(torch.uint8).numpy()) for r in rows]


def scatter_rows(buffers: list[torch.Tensor], slots: torch.Tensor,
                 frames: list[memoryview | bytes]) -> None:
    """Writes ``frames`` (one per buffer, ``byte_views``' layout, T rows each) at ``slots``
    (T,). Raises ``ValueError`` when a frame's size does not fit T rows of its buffer."""
    if len(frames) != len(buffers):
        raise ValueError(f"{len(frames)} KV frames for {len(buffers)} pool buffers")
    index = slots.to(buffers[0].device)
    count = len(slots)
    for buffer, frame in zip(buffers, frames):
        row = buffer.shape[1:]
        want = count * math.prod(row) * buffer.element_size()
        if len(frame) != want:
            raise ValueError(f"a KV frame of {len(frame)} bytes where {want} were expected")
        if not want:
            continue
        with warnings.catch_warnings():  # read only: the frame is never written through
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(frame, dtype=torch.uint8)
        rows = raw.view(buffer.dtype).view(count, *row)
        buffer.index_copy_(0, index, rows.to(buffer.device))

