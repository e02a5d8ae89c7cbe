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

Copies between the tiers are issued on the caller's thread, never waited for by the host:
- from the device pool (a write-back): the blocks' slots are gathered on the current stream
  into a device buffer first (``index_select``), so the pool's slots may be overwritten by
  the next pass at once; on CUDA the copy from that buffer into the pinned rows runs on a
  side stream of its own (after an event of the gather), overlapping the passes queued
  after it; the buffer is kept for that stream (``record_stream``), and ``_stored`` marks
  the copies' end;
- into it (a load): on the current stream, after ``_stored`` (a row just written back may
  be the one read), from the pinned rows into a device buffer and through the pool's
  ``write_rows``, in order with the passes before and after it, so a pass queued after a
  load reads the loaded KV; ``_loaded`` marks its end.
The host side waits (``wait_for_copies``: both events) only where it touches a row itself:
reading one for a file, or writing a block from disk into a row whose copies may still be
in flight.

Tensor parallelism: each rank's pool holds its share of the heads under the same slots, so
each rank holds its share of every block in the same row. Rank 0's tier decides everything
(keys, rows, LRU) and reports each change of a row to its ``mirror`` (``TierMirror``), under
the tier's lock, so the changes reach the other ranks in the order they happened here; the
other ranks copy the same slots into the same rows (``copy_from_pool``, ``copy_into_pool``,
``write_row``). A row filled from a file stays *unconfirmed* until every rank says it read
its own share of that block (``confirmed_run``): a block some rank could not read is dropped
before any rank loads it.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class HostTierStats:
    blocks: int
    capacity: int
    bytes_used: int
    bytes_written: int  # from the device pool (and from files) into the tier
    bytes_loaded: int  # from the tier into the device pool
    dropped: int  # blocks dropped to make room


class TierMirror(Protocol):
    """Where rank 0's host tier reports each change of a row, for the other ranks to make
    (``runtime/model_executor/host_tier_ranks.py``); every call but ``confirm`` only records."""

    def stored(self, row: int, slots: torch.Tensor, disk_key: str | None,
               tokens: Sequence[int]) -> None:
        """Row ``row`` now holds the KV of ``slots``; also write it to disk as ``disk_key``
        (None: not)."""

    def fetched(self, row: int, key: str) -> None:
        """Row ``row`` now holds block ``key`` as read from disk."""

    def loaded(self, rows: list[int], skip: int, slots: torch.Tensor) -> None:
        """The tokens of ``rows``, from the first one's token ``skip`` on, were copied into
        ``slots``."""

    def confirm(self, rows: list[int]) -> list[bool]:
        """Whether every rank holds its share of each of ``rows`` (waits for the ranks)."""

    def fetching(self, keys: Sequence[str]) -> None:
        """The disk tier starts reading ``keys``: the other ranks start reading theirs."""

    def device_written(self, key: str, tokens: Sequence[int], slots: torch.Tensor) -> None:
        """The KV of ``slots`` (device pool) is written to disk as ``key``, on every rank."""

    def close(self) -> None:
        """Sends what is recorded; the other ranks finish their disk writes."""


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
        self._side = torch.cuda.Stream(device=self.device) if pin else None
        """CUDA: the stream write-backs copy into the rows on."""
        self._stored = torch.cuda.Event() if pin else None
        self._loaded = torch.cuda.Event() if pin else None
        self._bytes_written = self._bytes_loaded = self._dropped = 0
        self.mirror: TierMirror | None = None
        """The other ranks' tiers (rank 0 of a tensor-parallel model), or None."""
        self._unconfirmed: set[int] = set()
        """Rows filled from files that not every rank has confirmed (with a mirror)."""

    # Queries ------------------------------------------------------------------------------

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    def run_length(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, are stored."""
        with self._lock:
            return len(self._leading_rows(keys))

    def _leading_rows(self, keys: Sequence[str]) -> list[int]:
        """(Holding the lock.) The rows of ``keys``, from the first, up to one not stored."""
        rows = []
        for key in keys:
            found = self._index.get(key)
            if found is None:
                break
            rows.append(found[0])
        return rows

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

    def put_from_pool(self, key: str, tokens: Sequence[int], pool, slots: torch.Tensor,
                      to_disk: bool = False) -> bool:
        """Stores the KV of ``slots`` ((block_tokens,) on the pool's device) of ``pool`` as
        block ``key``; False if it was stored already (refreshed). ``to_disk``: the caller
        writes the block to disk (the other ranks write their shares too)."""
        return self.put_run_from_pool([(key, tokens, to_disk)], pool, slots)[0]

    def put_run_from_pool(self, blocks: Sequence[tuple[str, Sequence[int], bool]], pool,
                          slots: torch.Tensor) -> list[bool]:
        """Stores block i of ``blocks`` ((key, tokens, to_disk) each, as ``put_from_pool``)
        from ``slots[i * block_tokens : (i + 1) * block_tokens]``, copying all of them with
        one gather a buffer; for each, whether it was stored now (False: stored already, and
        refreshed, or the run is longer than the tier and it was among its first blocks)."""
        size = self.block_tokens
        for _, tokens, _ in blocks:
            if len(tokens) != size:
                raise ValueError(f"a block holds {size} tokens, got {len(tokens)}")
        stored = [False] * len(blocks)
        with self._lock:
            fresh = []
            for i, (key, _, _) in enumerate(blocks):
                if key in self._index:
                    self._index.move_to_end(key)
                else:
                    fresh.append(i)
            if len(fresh) > self.capacity:  # (its first blocks would be dropped at once)
                self._dropped += len(fresh) - self.capacity
                fresh = fresh[len(fresh) - self.capacity:]
            if not fresh:
                return stored
            rows = [self._take_row() for _ in fresh]
            whole = len(fresh) * size == len(slots)
            try:
                self.copy_from_pool(rows, pool, slots if whole else torch.cat(
                    [slots[i * size : (i + 1) * size] for i in fresh]))
            except BaseException:
                self._free.extend(rows)
                raise
            for i, row in zip(fresh, rows):
                key, tokens, to_disk = blocks[i]
                self._unconfirmed.discard(row)
                if self.mirror is not None:
                    self.mirror.stored(row, slots[i * size : (i + 1) * size],
                                       key if to_disk else None, tokens)
                self._index[key] = (row, tuple(tokens))
                stored[i] = True
            self._bytes_written += len(fresh) * self.block_bytes
            return stored

    def put_tensors(self, key: str, tokens: Sequence[int], tensors: list[torch.Tensor]) -> bool:
        """Stores a block read from elsewhere (the disk tier: CPU tensors, one per buffer).
        The host writes the row itself, so copies still in flight from or to the row it
        takes (a block just dropped) must land first."""
        if len(tensors) != len(self.buffers):
            raise ValueError(f"a block has {len(self.buffers)} buffers, got {len(tensors)}")

        def copy(row: int) -> None:
            self.write_row(row, tensors)
            if self.mirror is not None:
                self._unconfirmed.add(row)
                self.mirror.fetched(row, key)
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
            row = self._take_row()
            try:
                copy(row)
            except BaseException:
                self._free.append(row)
                raise
            self._index[key] = (row, tuple(tokens))
            self._bytes_written += self.block_bytes
            return True

    def _take_row(self) -> int:
        """(Holding the lock.) A free row, the least recently used block dropped if none is
        (the caller indexes it, or gives it back to ``_free``)."""
        if not self._free:
            _, (dropped, _) = self._index.popitem(last=False)
            self._free.append(dropped)
            self._dropped += 1
        return self._free.pop()

    # Out of the tier ----------------------------------------------------------------------

    def load_into_pool(self, key: str, pool, slots: torch.Tensor, skip: int = 0) -> bool:
        """Copies block ``key``'s tokens from ``skip`` on into ``slots`` ((block_tokens -
        skip,) on the pool's device) of ``pool``; False if the block is not stored."""
        return self.load_run_into_pool([key], pool, slots, skip) == 1

    def load_run_into_pool(self, keys: Sequence[str], pool, slots: torch.Tensor,
                           skip: int = 0) -> int:
        """Copies the blocks ``keys`` (a run of a prompt's blocks), from the first one's
        token ``skip`` on, into ``slots`` of ``pool``, with one scatter a buffer; returns how
        many of ``keys``, from the first, were stored and copied (their tokens into the
        first ``n * block_tokens - skip`` slots)."""
        with self._lock:
            rows = self._leading_rows(keys)
            for key in keys[: len(rows)]:
                self._index.move_to_end(key)
            if not rows:
                return 0
            count = len(rows) * self.block_tokens - skip
            self.copy_into_pool(rows, pool, slots[:count], skip)
            if self.mirror is not None:
                self.mirror.loaded(rows, skip, slots[:count])
            self._bytes_loaded += count * self.block_bytes // self.block_tokens
            return len(rows)

    def confirmed_run(self, keys: Sequence[str]) -> tuple[int, list[str]]:
        """How many of ``keys``, from the first, are stored and held by every rank, and the
        keys of the run that some rank could not read (dropped here; the caller drops
        them from the disk too). Without a mirror: ``run_length``, nothing dropped."""
        with self._lock:  # (held while the ranks answer: no row changes meanwhile)
            rows = self._leading_rows(keys)
            run = len(rows)
            doubtful = [row for row in rows if row in self._unconfirmed]
            if not doubtful:
                return run, []
            held = dict(zip(doubtful, self.mirror.confirm(doubtful), strict=True))
            self._unconfirmed.difference_update(doubtful)
            lost = [key for key, row in zip(keys[:run], rows) if not held.get(row, True)]
            for key in lost:
                self._free.append(self._index.pop(key)[0])
            return next((n for n, row in enumerate(rows) if not held.get(row, True)), run), lost

    # Rows (each rank's copies; the index above is rank 0's) -------------------------------

    def copy_from_pool(self, rows: Sequence[int], pool, slots: torch.Tensor) -> None:
        """Rows ``rows`` = the KV of ``slots`` ((len(rows) * block_tokens,) on the pool's
        device), one block a row: one gather a buffer, one copy a run of adjacent rows (on
        CUDA on the side stream: see the module)."""
        size, runs = self.block_tokens, _adjacent_runs(rows)
        # (the current stream: the KV as the passes before left it)
        gathered = [device.index_select(0, slots) for device in pool.layer_buffers()]
        side = self._side
        if side is not None:
            ready = torch.cuda.Event()
            ready.record()
            side.wait_event(ready)
        with contextlib.nullcontext() if side is None else torch.cuda.stream(side):
            for host, data in zip(self.buffers, gathered, strict=True):
                at = 0
                for row, count in runs:
                    host[row : row + count].copy_(
                        data[at * size : (at + count) * size].view(count, size,
                                                                   *host.shape[2:]),
                        non_blocking=True)
                    at += count
                if side is not None:
                    data.record_stream(side)
            if side is not None:
                self._stored.record(side)

    def copy_into_pool(self, rows: Sequence[int], pool, slots: torch.Tensor,
                       skip: int = 0) -> None:
        """``slots`` ((len(rows) * block_tokens - skip,)) of ``pool`` = the tokens of rows
        ``rows``, one after another, from the first one's token ``skip`` on: one scatter a
        buffer (on CUDA from the pinned rows through a device buffer, on the current stream
        once the side stream's write-backs landed)."""
        runs = _adjacent_runs(rows)
        if self._side is not None:
            torch.cuda.current_stream().wait_event(self._stored)
        for host, device in zip(self.buffers, pool.layer_buffers(), strict=True):
            parts = [host[row : row + count].flatten(0, 1) for row, count in runs]
            if self._side is not None:  # (no pageable staging, no host wait)
                staged = torch.empty((sum(len(p) for p in parts), *host.shape[2:]),
                                     dtype=host.dtype, device=device.device)
                at = 0
                for part in parts:
                    staged[at : at + len(part)].copy_(part, non_blocking=True)
                    at += len(part)
            else:
                staged = parts[0] if len(parts) == 1 else torch.cat(parts)
            pool.write_rows(device, slots, staged[skip:])
        if self._loaded is not None:
            self._loaded.record()

    def write_row(self, row: int, tensors: Sequence[torch.Tensor]) -> None:
        """Row ``row`` = ``tensors`` (CPU, one per buffer), once copies in flight landed."""
        self.wait_for_copies()
        for host, tensor in zip(self.buffers, tensors, strict=True):
            host[row].copy_(tensor)

    def row_tensors(self, row: int) -> list[torch.Tensor]:
        """Copies of row ``row``'s buffers (CPU), once copies in flight landed."""
        self.wait_for_copies()
        return [host[row].clone() for host in self.buffers]

    def block_tensors(self, key: str) -> list[torch.Tensor] | None:
        """Copies of block ``key``'s buffers (CPU), for a file; None if not stored."""
        with self._lock:
            found = self._index.get(key)
            return None if found is None else self.row_tensors(found[0])

    def wait_for_copies(self) -> None:
        """Waits until the copies to and from the device pool issued so far have landed
        (CUDA: the write-backs on the side stream, the loads on the stream that issued
        them; a CPU copy is done when issued)."""
        if self._side is not None:
            self._stored.synchronize()
            self._loaded.synchronize()

    def clear(self) -> None:
        with self._lock:
            self._index.clear()
            self._unconfirmed.clear()
            self._free = list(range(self.capacity - 1, -1, -1))


def _adjacent_runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """``rows`` as (first row, count) runs of consecutive rows, in order."""
    runs: list[tuple[int, int]] = []
    for row in rows:
        if runs and runs[-1][0] + runs[-1][1] == row:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((row, 1))
    return runs
