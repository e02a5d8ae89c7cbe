"""The host tier (L2) of the hierarchical prefix cache: KV blocks in host memory, LRU.

A block is the KV of ``block_tokens`` consecutive tokens of some prefix, keyed as the disk
tier keys it (``disk_kv_store.chained_block_keys``: a hash of the whole prefix up to the
block's end, its namespace and the model's identity), so a key names one content wherever it
is stored. The tier holds ``capacity`` blocks in buffers allocated once, one per per-slot
buffer of the device pool (``layer_buffers()`` order), each (capacity, block_tokens,
*slot_shape) of the pool's dtype: on a CUDA pool in pinned memory, so copies run without
staging; on a CPU pool in plain memory (a separate, larger budget than the device pool's).

Invariants:
- ``_index`` maps each stored key to its block row and the block's tokens, oldest use first;
  ``len(_index) + len(_free) == capacity`` and no row is both stored and free;
- ``put`` of a stored key only refreshes it (a key names one content); a full tier first
  drops its least recently used block (``dropped`` counts them); nothing is ever partly
  stored: a block is indexed only after its copy was issued;
- every method holds ``_lock``, so the scheduler thread (writes from the device pool, loads
  into it) and the disk worker (blocks read from files, blocks read for files) may share it.

Copies between the tiers are issued on the caller's thread: from the device pool with
``index_select`` and ``copy_``, into it with the pool's ``write_rows`` (on CUDA both are
queued on the current stream, in order with the passes before and after them, so a forward
pass queued after a load reads the loaded KV, and a slot freed after a write-back is
overwritten only after it was read, without a host wait). The host side waits
(``wait_for_copies``) only where it touches a row itself: reading one for a file, or
writing a block from disk into a row whose copies may still be in flight.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class HostTierStats:
    blocks: int
    capacity: int
    bytes_used: int
    bytes_written: int  # from the device pool (and from files) into the tier
    bytes_loaded: int  # from the tier into the device pool
    dropped: int  # blocks dropped to make room


class HostKVBlocks:
    """``capacity`` blocks of KV in host memory (see the module)."""

    def __init__(self, pool, block_tokens: int, capacity: int):
        """``pool``: the device pool the blocks come from and go to (its
        ``layer_buffers()`` give the per-slot shapes and the dtype)."""
        if capacity < 1:
            raise ValueError(f"the host tier needs room for at least one block, got {capacity}")
        device_buffers = pool.layer_buffers()
        self.device = device_buffers[0].device
        pin = self.device.type == "cuda"
        self.block_tokens = block_tokens
        self.capacity = capacity
        self.buffers = [torch.empty((capacity, block_tokens, *b.shape[1:]), dtype=b.dtype,
                                    pin_memory=pin) for b in device_buffers]
        self.block_bytes = sum(b[0].numel() * b.element_size() for b in self.buffers)
        self._index: OrderedDict[str, tuple[int, tuple[int, ...]]] = OrderedDict()
        self._free = list(range(capacity - 1, -1, -1))
        self._lock = threading.Lock()
        self._copies = torch.cuda.Event() if pin else None
        self._bytes_written = self._bytes_loaded = self._dropped = 0

    # Queries ------------------------------------------------------------------------------

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    def run_length(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, are stored."""
        with self._lock:
            for n, key in enumerate(keys):
                if key not in self._index:
                    return n
            return len(keys)

    def tokens_of(self, key: str) -> tuple[int, ...] | None:
        with self._lock:
            found = self._index.get(key)
            return None if found is None else found[1]

    def stats(self) -> HostTierStats:
        with self._lock:
            return HostTierStats(len(self._index), self.capacity,
                                 len(self._index) * self.block_bytes, self._bytes_written,
                                 self._bytes_loaded, self._dropped)

    # Into the tier ------------------------------------------------------------------------

    def put_from_pool(self, key: str, tokens: Sequence[int], pool,
                      slots: torch.Tensor) -> bool:
        """Stores the KV of ``slots`` ((block_tokens,) on the pool's device) of ``pool`` as
        block ``key``; False if it was stored already (refreshed)."""
        def copy(row: int) -> None:
            for host, device in zip(self.buffers, pool.layer_buffers(), strict=True):
                host[row].copy_(device.index_select(0, slots), non_blocking=True)
            if self._copies is not None:
                self._copies.record()
        return self._put(key, tokens, copy)

    def put_tensors(self, key: str, tokens: Sequence[int], tensors: list[torch.Tensor]) -> bool:
        """Stores a block read from elsewhere (the disk tier: CPU tensors, one per buffer).
        The host writes the row itself, so copies still in flight from or to the row it
        takes (a block just dropped) must land first."""
        if len(tensors) != len(self.buffers):
            raise ValueError(f"a block has {len(self.buffers)} buffers, got {len(tensors)}")

        def copy(row: int) -> None:
            self.wait_for_copies()
            for host, tensor in zip(self.buffers, tensors, strict=True):
                host[row].copy_(tensor)
        return self._put(key, tokens, copy)

    def _put(self, key: str, tokens: Sequence[int], copy) -> bool:
        """Stores block ``key`` by ``copy(row)`` into a free row (the least recently used
        block dropped if none is), indexed only once the copy was issued; a copy that
        raises leaves the row free. False if ``key`` is stored (refreshed)."""
        if len(tokens) != self.block_tokens:
            raise ValueError(f"a block holds {self.block_tokens} tokens, got {len(tokens)}")
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return False
            if not self._free:
                _, (dropped, _) = self._index.popitem(last=False)
                self._free.append(dropped)
                self._dropped += 1
            row = self._free.pop()
            try:
                copy(row)
            except BaseException:
                self._free.append(row)
                raise
            self._index[key] = (row, tuple(tokens))
            self._bytes_written += self.block_bytes
            return True

    # Out of the tier ----------------------------------------------------------------------

    def load_into_pool(self, key: str, pool, slots: torch.Tensor, skip: int = 0) -> bool:
        """Copies block ``key``'s tokens from ``skip`` on into ``slots`` ((block_tokens -
        skip,) on the pool's device) of ``pool``; False if the block is not stored."""
        with self._lock:
            found = self._index.get(key)
            if found is None:
                return False
            self._index.move_to_end(key)
            row = found[0]
            for host, device in zip(self.buffers, pool.layer_buffers()):
                rows = host[row, skip:].to(device.device, non_blocking=True)
                pool.write_rows(device, slots, rows)
            if self._copies is not None:
                self._copies.record()
            self._bytes_loaded += (self.block_tokens - skip) * self.block_bytes \
                // self.block_tokens
            return True

    def block_tensors(self, key: str) -> list[torch.Tensor] | None:
        """Copies of block ``key``'s buffers (CPU), for a file; None if not stored."""
        self.wait_for_copies()
        with self._lock:
            found = self._index.get(key)
            if found is None:
                return None
            return [host[found[0]].clone() for host in self.buffers]

    def wait_for_copies(self) -> None:
        """Waits until the copies to and from the device pool issued so far have landed
        (CUDA: they run on the stream that issued them, in order with the passes around
        them; a CPU copy is done when issued)."""
        if self._copies is not None:
            self._copies.synchronize()

    def clear(self) -> None:
        with self._lock:
            self._index.clear()
            self._free = list(range(self.capacity - 1, -1, -1))
