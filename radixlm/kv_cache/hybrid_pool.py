"""A KV pool for models with sliding-window layers: the window's layers keep only the tokens
inside their window.

A sliding layer with window W attends, at query position i, to keys j with i - W < j <= i
(Mistral, Phi-3, Gemma 2/3's local layers), so the KV of a token more than W tokens behind
every query still to come is dead for it, though the full-attention layers still read
theirs. ``HybridKVPool`` keeps the two kinds apart:

- full-attention layers: K and V buffers of ``num_slots`` rows, indexed by the request's
  slots (what ``req_to_token`` holds), as ``MHATokenToKVPool``;
- sliding layers: K and V buffers of ``num_local_slots`` rows, indexed by local slots;
  ``slot_map_for(layer)`` is the one (num_slots,) map from request slots to local slots
  (0: the token's local KV was dropped; the padding slot) that backends apply to every
  sliding layer (the same tensor object for all of them).

``HybridAllocator`` hands out request slots as ``TokenToKVPoolAllocator`` does and pairs
each request page it takes with a page of its own local allocator (same ``page_size``), so
a page's local slots follow its request slots offset for offset. Invariants:

- ``page_map[p]`` is the local page paired with request page ``p`` (0: none); a local page
  is paired with at most one request page, and is free exactly when paired with none;
- ``slot_map[p * page + o] == page_map[p] * page + o`` for every page ``p`` and offset
  ``o`` (0 where ``page_map[p]`` is 0);
- ``free(slots)`` returns the request pages and their local pages; ``release_local(slots)``
  returns only the local pages (a token that fell out of every window), and its map entries
  read 0 from then on. Both take whole pages: every token of a page must be dead.

Buffers are made by ``memory_pool._zeros``: fresh anonymous mappings the OS fills as they
are first written, so the resident memory follows what is used.
"""

from __future__ import annotations

import torch

from radixlm.host_to_device import to_device
from radixlm.kv_cache.allocator import OutOfKVSlots, TokenToKVPoolAllocator
from radixlm.kv_cache.memory_pool import RowWriter, _zeros, index_copy_rows


class HybridAllocator(TokenToKVPoolAllocator):
    """Request slots in pages, each page paired with a local page (module docstring).

    ``size`` and ``available_size()`` count request slots, as the plain allocator's;
    ``local.size`` and ``local_available_size()`` the local ones.
    """

    def __init__(self, size: int, local_size: int, page_size: int = 1,
                 device: str | torch.device = "cpu"):
        self.local = TokenToKVPoolAllocator(local_size, page_size, device)
        num_pages = size // page_size if page_size >= 1 else 0
        self.page_map = torch.zeros(num_pages + 1, dtype=torch.int64)
        """Host copy: request page -> local page (0: none)."""
        self.slot_map = torch.zeros((num_pages + 1) * max(page_size, 1), dtype=torch.int64,
                                    device=device)
        """On the device: request slot -> local slot (0: none), read by the backends."""
        super().__init__(size, page_size, device)

    def reset(self) -> None:
        super().reset()
        self.local.reset()
        self.page_map.zero_()
        self.slot_map.zero_()

    def local_available_size(self) -> int:
        return self.local.available_size()

    def local_held(self, slots: torch.Tensor) -> torch.Tensor:
        """(N,) bool on the host: whether each slot's local KV is still held."""
        pages = slots.cpu() // self.page_size
        return self.page_map[pages] != 0

    def free_pages(self, pages: list[int]) -> None:
        """Returns ``pages``, request and local (where still held)."""
        self._unpair(pages)
        super().free_pages(pages)

    def release_local(self, slots: torch.Tensor) -> int:
        """Returns the local pages of the pages ``slots`` lie in (those still held) and
        zeroes their map entries; the request pages stay allocated. Returns the number of
        local slots freed."""
        if slots.numel() == 0:
            return 0
        return self._unpair(self._pages(slots)) * self.page_size

    def move_local(self, src: torch.Tensor, dst: torch.Tensor) -> int:
        """Hands the local pages of ``src``'s pages to ``dst``'s pages ((N,) slots each, at
        the same offsets), where ``dst``'s page holds none and ``src``'s does: the tree
        adopts a request's local KV of tokens it had cached without it (same tokens, same
        KV). Returns the number of pages moved."""
        if src.numel() == 0:
            return 0
        src_pages = (src.cpu() // self.page_size).tolist()
        dst_pages = (dst.cpu() // self.page_size).tolist()
        moved: dict[int, int] = {}
        for s, d in zip(src_pages, dst_pages):
            if s != d and d not in moved and self.page_map[d] == 0 and self.page_map[s] != 0:
                moved[d] = s
        if not moved:
            return 0
        dst_list = list(moved)
        src_list = [moved[d] for d in dst_list]
        local = self.page_map[src_list].tolist()
        self.page_map[src_list] = 0
        self._write_map(src_list, [0] * len(src_list))
        self.page_map[dst_list] = torch.tensor(local, dtype=torch.int64)
        self._write_map(dst_list, local)
        return len(dst_list)

    def _take_pages(self, num_pages: int) -> list[int]:
        pages = super()._take_pages(num_pages)
        try:
            local = self.local._take_pages(num_pages)
        except OutOfKVSlots:
            self._free_pages.extend(pages)
            raise
        if pages:
            self.page_map[pages] = torch.tensor(local, dtype=torch.int64)
            self._write_map(pages, local)
        return pages

    def _unpair(self, pages: list[int]) -> int:
        """Frees the local pages paired with ``pages``; returns how many there were."""
        if not pages:
            return 0
        local = self.page_map[pages]
        held = local != 0
        if not bool(held.any()):
            return 0
        paired = torch.tensor(pages, dtype=torch.int64)[held].tolist()
        self.local._free_pages.extend(local[held].tolist())
        self.page_map[paired] = 0
        self._write_map(paired, [0] * len(paired))
        return len(paired)

    def _write_map(self, pages: list[int], local_pages: list[int]) -> None:
        """Sets ``slot_map`` over whole pages: page ``p`` -> local page ``q`` (0: none)."""
        page = self.page_size
        pages_t = to_device(pages, torch.int64, self.device)
        local_t = to_device(local_pages, torch.int64, self.device)
        if page == 1:
            self.slot_map[pages_t] = local_t
            return
        offsets = torch.arange(page, device=self.device)
        slots = (pages_t[:, None] * page + offsets).reshape(-1)
        values = torch.where(local_t[:, None] == 0, 0, local_t[:, None] * page + offsets)
        self.slot_map[slots] = values.reshape(-1)


class HybridKVPool:
    """K and V per layer: full-attention layers under request slots, sliding layers under
    local slots through ``slot_map`` (module docstring). ``num_slots`` and
    ``num_local_slots`` include their padding page."""

    values_view_keys = False

    def __init__(
        self, num_slots: int, num_local_slots: int, num_layers: int,
        sliding_layers: frozenset[int], num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: str | torch.device, slot_map: torch.Tensor,
        write_rows: RowWriter = index_copy_rows,
    ):
        if slot_map.shape[0] != num_slots:
            raise ValueError(f"slot_map has {slot_map.shape[0]} entries, the pool {num_slots} "
                             "request slots")
        self.num_slots = num_slots
        self.num_local_slots = num_local_slots
        self.dtype = dtype
        self.write_rows = write_rows
        self.slot_map = slot_map
        self.sliding_layers = frozenset(sliding_layers)
        rows = [num_local_slots if i in self.sliding_layers else num_slots
                for i in range(num_layers)]
        self.k_buffers = [_zeros((n, num_kv_heads, head_dim), dtype, device) for n in rows]
        self.v_buffers = [_zeros((n, num_kv_heads, head_dim), dtype, device) for n in rows]

    def set_kv(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores k, v (T, H_kv, D) of the new tokens at the request's ``slots`` (T,),
        mapped to local slots in a sliding layer (a dropped token's go to padding)."""
        if layer_id in self.sliding_layers:
            slots = self.slot_map[slots]
        self.write_rows(self.k_buffers[layer_id], slots, k)
        self.write_rows(self.v_buffers[layer_id], slots, v)

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    def slot_map_for(self, layer_id: int) -> torch.Tensor | None:
        """The request-slot -> local-slot map for a sliding layer; None for a full one."""
        return self.slot_map if layer_id in self.sliding_layers else None

    def layer_buffers(self) -> list[torch.Tensor]:
        """Every per-slot buffer: K and V of layer 0, then layer 1, ... (a sliding layer's
        have ``num_local_slots`` rows)."""
        return [b for pair in zip(self.k_buffers, self.v_buffers) for b in pair]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copies the KV at request slots ``src`` to ``dst`` in every layer, through the
        map in sliding layers (a dropped source copies padding: a dead token stays dead)."""
        local_src, local_dst = self.slot_map[src], self.slot_map[dst]
        for layer, (k, v) in enumerate(zip(self.k_buffers, self.v_buffers)):
            s, d = (local_src, local_dst) if layer in self.sliding_layers else (src, dst)
            self.write_rows(k, d, k.index_select(0, s))
            self.write_rows(v, d, v.index_select(0, s))

    def bytes_per_token(self) -> int:
        """Bytes a token takes in the full-attention layers and the sliding ones together
        (a token inside its window)."""
        k = self.k_buffers[0]
        return 2 * len(self.k_buffers) * k.shape[1] * k.shape[2] * k.element_size()

    def bytes_per_local_token(self) -> int:
        k = self.k_buffers[0]
        return 2 * len(self.sliding_layers) * k.shape[1] * k.shape[2] * k.element_size()
