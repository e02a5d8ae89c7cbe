"""The KV memory: a request-to-token index table and a token-to-KV pool, both allocated once.

- ``ReqToTokenPool``: one row per running request; row r, column i holds the KV slot of
  token i of the request in row r. Rows are handed out and returned by request.
- ``MHATokenToKVPool``: per layer, one K and one V buffer of shape (num_slots, H_kv, D).
- ``MLATokenToKVPool``: per layer, one buffer (num_slots, 1, kv_lora_rank + qk_rope_head_dim)
  of compressed latents and rotated shared keys; the values are a view of it.

Slot indices come from ``TokenToKVPoolAllocator``; slots of page 0 are padding. Both token
pools answer ``set_kv``, ``get_kv``, ``layer_buffers`` and ``bytes_per_token``; ``set_kv``
writes through ``write_rows`` (``buffer.index_copy_(0, slots, rows)``, or a faster function
of the same effect the runner passes in, such as the fused CPU kernels' ``scatter_rows``);
``values_view_keys`` tells an attention backend that the values are the first
``v_buffer.shape[-1]`` dims of the keys, so it may gather keys once and slice the values
out of them.

A pool may hold some layers' KV under slots of their own (the sliding-window layers of a
hybrid pool hold only the tokens inside their window): ``slot_map_for(layer_id)`` is then
a (num_slots,) int64 tensor taking a request's slot (what ``req_to_token`` holds) to the
slot of that layer's buffers (0, padding, where the token's KV there was dropped), which a
backend applies to the slots it reads that layer at; ``set_kv`` takes the request's slots
and maps them itself. None: the layer's buffers are indexed by the request's slots (every
layer of these two pools).

No KV tensor is ever allocated per request: a request owns indices, not memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from radixlm.kernels.cpu_ops import huge_pages

RowWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
"""write_rows(buffer (N, ...), slots (T,), rows (T, ...)): buffer[slots] = rows."""


def index_copy_rows(buffer: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    buffer.index_copy_(0, slots, rows)


class ReqToTokenPool:
    """Rows of KV slot indices, one per running request."""

    def __init__(self, max_requests: int, max_context_len: int, device: str | torch.device):
        self.size = max_requests
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros(
            (max_requests, max_context_len), dtype=torch.int64, device=device
        )
        self._free_rows = list(range(max_requests - 1, -1, -1))
        self.rewritten: dict[int, int] = {}
        """Rows whose first n slots were replaced in place (row -> n) since the last
        forward pass took note: a row otherwise only grows, at the slots a pass writes,
        which is what tensor-parallel ranks mirror (``tensor_parallel_ranks``)."""

    def mark_rewritten(self, row: int, length: int) -> None:
        self.rewritten[row] = max(length, self.rewritten.get(row, 0))

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        """A free row, or None when every row is taken."""
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def reset(self) -> None:
        self._free_rows = list(range(self.size - 1, -1, -1))


def copy_slots(pool: MHATokenToKVPool | MLATokenToKVPool, src: torch.Tensor,
               dst: torch.Tensor) -> None:
    """Copies the KV stored at slots ``src`` to slots ``dst`` ((N,) each, on the pool's
    device), in every layer: a page shared by two sequences that go on differently is
    copied on write (beam search). A pool whose layers keep slots of their own
    (``slot_map_for``; ``hybrid_pool.HybridKVPool``) copies through its ``copy_slots``."""
    own_copy = getattr(pool, "copy_slots", None)
    if own_copy is not None:
        own_copy(src, dst)
        return
    for buffer in pool.layer_buffers():
        pool.write_rows(buffer, dst, buffer.index_select(0, src))


class MHATokenToKVPool:
    """K and V for every slot of every layer (multi-head, grouped- or multi-query layout).

    ``num_slots`` includes the reserved padding page; slot indices are those of the allocator.
    """

    values_view_keys = False

    def __init__(
        self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: str | torch.device, write_rows: RowWriter = index_copy_rows,
    ):
        self.num_slots = num_slots
        self.dtype = dtype
        self.write_rows = write_rows
        shape = (num_slots, num_kv_heads, head_dim)
        self.k_buffers = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v_buffers = [_zeros(shape, dtype, device) for _ in range(num_layers)]

    def set_kv(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores k, v (T, H_kv, D) of the new tokens at ``slots`` (T,)."""
        self.write_rows(self.k_buffers[layer_id], slots, k)
        self.write_rows(self.v_buffers[layer_id], slots, v)

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    def slot_map_for(self, layer_id: int) -> torch.Tensor | None:
        """None: every layer is indexed by the request's slots (see the module docstring)."""
        return None

    def layer_buffers(self) -> list[torch.Tensor]:
        """Every per-slot buffer, (num_slots, ...) each: K and V of layer 0, then layer 1, ...
        (what moves a token's KV between pools, ``disaggregation``)."""
        return [b for pair in zip(self.k_buffers, self.v_buffers) for b in pair]

    def bytes_per_token(self) -> int:
        k = self.k_buffers[0]
        return 2 * len(self.k_buffers) * k.shape[1] * k.shape[2] * k.element_size()


class MLATokenToKVPool:
    """The latent KV of multi-head latent attention (DeepSeek-V2, Liu et al. 2024).

    Layout, per layer: one contiguous buffer ``kv_buffers[layer]`` of shape
    (num_slots, 1, kv_lora_rank + qk_rope_head_dim); the row of a slot is

        [ c_kv : kv_lora_rank dims | k_rope : qk_rope_head_dim dims ]

    c_kv is the token's normalised compressed KV latent, k_rope its rotated key part shared
    by all heads (rotate-half pair layout, already multiplied by RoPE's attention factor).
    For the absorbed attention this is multi-query attention with one KV head: the key is
    the whole row (D_k = kv_lora_rank + qk_rope_head_dim) and the value is c_kv
    (D_v = kv_lora_rank), read as a view of the same buffer, never stored twice.

    ``set_kv(layer, slots, k, v)`` stores k (T, 1, D_k); v must be k's first D_v dims (the
    view the attention layer passes) and is not written. ``get_kv(layer)`` returns
    (key buffer (num_slots, 1, D_k), value view (num_slots, 1, D_v)).
    """

    values_view_keys = True

    def __init__(
        self, num_slots: int, num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int,
        dtype: torch.dtype, device: str | torch.device, write_rows: RowWriter = index_copy_rows,
    ):
        self.num_slots = num_slots
        self.dtype = dtype
        self.write_rows = write_rows
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        shape = (num_slots, 1, kv_lora_rank + qk_rope_head_dim)
        self.kv_buffers = [_zeros(shape, dtype, device) for _ in range(num_layers)]

    def set_kv(
        self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None
    ) -> None:
        """Stores the new tokens' rows k (T, 1, kv_lora_rank + qk_rope_head_dim) at ``slots``."""
        self.write_rows(self.kv_buffers[layer_id], slots, k)

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        buffer = self.kv_buffers[layer_id]
        return buffer, buffer[..., : self.kv_lora_rank]

    def slot_map_for(self, layer_id: int) -> torch.Tensor | None:
        """None: every layer is indexed by the request's slots (see the module docstring)."""
        return None

    def layer_buffers(self) -> list[torch.Tensor]:
        """Every per-slot buffer, (num_slots, 1, D_k) each, by layer."""
        return list(self.kv_buffers)

    def bytes_per_token(self) -> int:
        buffer = self.kv_buffers[0]
        return len(self.kv_buffers) * buffer.shape[2] * buffer.element_size()


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """A zeroed KV buffer; on a CPU, on huge pages where the system gives them (a decode
    step gathers its keys from all over the pool: ``huge_pages.py``)."""
    if torch.device(device).type == "cpu":
        return huge_pages.zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)
