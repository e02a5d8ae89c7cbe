"""The hierarchical prefix cache over tensor-parallel ranks: rank 0's tiers decide, every
other rank copies its share of the same KV to and from the same host rows and files.

Each rank's KV pool holds its share of the heads under the same slots (``tensor_parallel_
ranks``), so a block's KV is split the same way: each rank keeps its share of every block
in the same row of its own host tier and writes it to its own disk directory (``rank_
directory``) under the same key. Rank 0 alone keeps the index (keys, rows, LRU, what is on
disk) and records every change of a row (``HostTierLog``, the ``TierMirror`` of its
``HostKVBlocks``), in the order it made them; ``StepSender`` broadcasts what was recorded
before the next message of any kind (a forward pass, logits, a keep-alive), so a rank makes
the changes before the pass that reads the slots they load, and copies evicted slots before
a later pass overwrites them. The ranks apply them in order (``HostTierFollower``).

Disk reads are the one place the ranks can disagree: rank 0 read its file of a block, but
another rank's file may be missing or damaged. So a rank starts reading a block when rank 0
starts (``FETCH``, ahead, in its own reader threads), fills the row when rank 0 did
(``FETCHED``), and before rank 0 loads any row filled from a file into the device pool, the
ranks agree that each holds its share (``CONFIRM``: an all-reduce of one flag a row, the
minimum); a block some rank lacks is dropped on rank 0 (and from its disk) and recomputed.

Messages are int64 only (keys as their 32 bytes, tokens, rows on the CPU group; slots on the
model's group, so on GPUs they never leave the device): nothing is pickled.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

from radixlm.kv_cache.disk_kv_store import DiskKVStore
from radixlm.kv_cache.host_kv_blocks import HostKVBlocks
from radixlm.kv_cache.kv_block_format import StoreIdentity

logger = logging.getLogger(__name__)

OPEN, STORE, LOAD, FETCH, FETCHED, CONFIRM, DEVICE_WRITE, CLOSE = range(1, 9)
KEY_INTS = 32
"""A block key (64 hex digits) crosses as its 32 bytes, an int64 each."""
DISK_READERS = 4


def rank_directory(directory: str, rank: int, size: int) -> str:
    """The disk tier's directory of ``rank`` of ``size`` (the directory itself with one)."""
    return directory if size == 1 else str(Path(directory) / f"tp{size}-rank{rank}")


def key_ints(key: str) -> list[int]:
    return list(bytes.fromhex(key))


def key_of(ints: Sequence[int]) -> str:
    return bytes(ints).hex()


class HostTierLog:
    """Rank 0: the changes its tiers made to host rows, recorded until ``StepSender`` sends
    them (``take``); a ``TierMirror``."""

    def __init__(self, sender):
        """``sender``: rank 0's ``StepSender`` (it sends what ``take`` gives)."""
        self.sender = sender
        self._lock = threading.Lock()
        self._host: list[int] = []
        self._slots: list[torch.Tensor] = []

    def _record(self, host: list[int], slots: torch.Tensor | None = None) -> None:
        with self._lock:
            self._host += host
            if slots is not None:
                self._slots.append(slots)

    def take(self) -> tuple[list[int], torch.Tensor | None] | None:
        """What was recorded since the last ``take`` (host ints, slots), or None."""
        with self._lock:
            if not self._host:
                return None
            host, slots = self._host, self._slots
            self._host, self._slots = [], []
        return host, (torch.cat(slots).to(torch.int64) if slots else None)

    def opened(self, fingerprint: str) -> None:
        """The ranks open their disk tiers, for blocks keyed under ``fingerprint``."""
        self._record([OPEN, *key_ints(fingerprint)])

    # TierMirror ----------------------------------------------------------------------------

    def stored(self, row: int, slots: torch.Tensor, disk_key: str | None,
               tokens: Sequence[int]) -> None:
        disk = [] if disk_key is None else [*key_ints(disk_key), *tokens]
        self._record([STORE, row, len(slots), int(disk_key is not None), *disk], slots)

    def fetched(self, row: int, key: str) -> None:
        self._record([FETCHED, row, *key_ints(key)])

    def loaded(self, rows: list[int], skip: int, slots: torch.Tensor) -> None:
        self._record([LOAD, skip, len(slots), len(rows), *rows], slots)

    def confirm(self, rows: list[int]) -> list[bool]:
        self._record([CONFIRM, len(rows), *rows])
        return self.sender.exchange_tier_changes(agree=len(rows))

    # The disk tier -------------------------------------------------------------------------

    def fetching(self, keys: Sequence[str]) -> None:
        """Rank 0 starts reading ``keys`` from disk: so do the others, each its share."""
        for key in keys:
            self._record([FETCH, *key_ints(key)])

    def device_written(self, key: str, tokens: Sequence[int], slots: torch.Tensor) -> None:
        """Rank 0 writes the KV of ``slots`` (device pool) to disk as ``key``."""
        self._record([DEVICE_WRITE, len(slots), *key_ints(key), *tokens], slots)

    def close(self) -> None:
        """Sends what is recorded and waits for the ranks to finish their disk writes (they
        may be stopped right after)."""
        self._record([CLOSE])
        self.sender.exchange_tier_changes(agree=1)


class HostTierFollower:
    """Ranks 1..N-1: this rank's share of rank 0's host rows and disk blocks."""

    def __init__(self, pool, block_tokens: int, capacity: int, disk_directory: str | None,
                 disk_capacity_bytes: int, page_size: int, rank: int, size: int):
        self.pool = pool
        self.block_tokens = block_tokens
        self.host = HostKVBlocks(pool, block_tokens, capacity)  # (rows only: no index here)
        self.disk_directory, self.disk_capacity_bytes = disk_directory, disk_capacity_bytes
        self.page_size, self.rank, self.size = page_size, rank, size
        self.disk: DiskKVStore | None = None
        self._writer: ThreadPoolExecutor | None = None
        self._readers: ThreadPoolExecutor | None = None
        self._reading: OrderedDict[str, Future] = OrderedDict()
        """Blocks rank 0 started reading, by key, until it fills a row with one."""
        self._pending: dict[int, Future | None] = {}
        """Rows rank 0 filled from disk whose read here is not in the row yet."""
        self._bad: set[int] = set()
        """Rows whose block this rank could not read."""
        self._lock = threading.Lock()
        self._generation = [0] * capacity
        """Changes of each row so far: a queued disk write of a row changed since is lost."""

    def apply(self, host: list[int], slots: torch.Tensor | None, cpu_group) -> None:
        """Makes the changes rank 0 recorded, in order (``HostTierLog``)."""
        at = cursor = 0
        size = self.block_tokens

        def take(count: int) -> list[int]:
            nonlocal at
            at += count
            return host[at - count : at]

        def slot_run(count: int) -> torch.Tensor:
            nonlocal cursor
            cursor += count
            return slots[cursor - count : cursor]

        while at < len(host):
            op = take(1)[0]
            if op == STORE:
                row, count, to_disk = take(3)
                key, tokens = (key_of(take(KEY_INTS)), take(size)) if to_disk else (None, None)
                self._store(row, slot_run(count), key, tokens)
            elif op == LOAD:
                skip, count, rows = take(3)
                self._load(take(rows), skip, slot_run(count))
            elif op == FETCH:
                self._fetch(key_of(take(KEY_INTS)))
            elif op == FETCHED:
                row = take(1)[0]
                self._fetched(row, key_of(take(KEY_INTS)))
            elif op == CONFIRM:
                self._confirm(take(take(1)[0]), cpu_group)
            elif op == DEVICE_WRITE:
                count = take(1)[0]
                key, tokens, block = key_of(take(KEY_INTS)), take(size), slot_run(count)
                tensors = [b.index_select(0, block).cpu() for b in self.pool.layer_buffers()]
                self._writer.submit(self._write, key, tokens, tensors)
            elif op == OPEN:
                self._open(key_of(take(KEY_INTS)))
            elif op == CLOSE:
                self.close()
                done = torch.ones(1, dtype=torch.int64)  # (rank 0 waits for this)
                dist.all_reduce(done, op=dist.ReduceOp.MIN, group=cpu_group)
            else:
                raise ValueError(f"unknown host-tier change {op} from rank 0")

    def _open(self, fingerprint: str) -> None:
        """This rank's disk tier: its own directory, its share's identity, named by rank 0's
        keys (whose ``fingerprint`` covers the model, the tokenizer and the sizes)."""
        identity = StoreIdentity.of_pool(
            self.pool, model=fingerprint, tokenizer=fingerprint, page_size=self.page_size,
            block_tokens=self.block_tokens, tp_rank=self.rank, tp_size=self.size)
        self.disk = DiskKVStore(rank_directory(self.disk_directory, self.rank, self.size),
                                identity, self.disk_capacity_bytes)
        self._writer = ThreadPoolExecutor(1, "radixlm-kv-disk")
        self._readers = ThreadPoolExecutor(DISK_READERS, "radixlm-kv-read")

    def _changed(self, row: int) -> None:
        with self._lock:
            self._generation[row] += 1
        self._pending.pop(row, None)
        self._bad.discard(row)

    def _store(self, row: int, slots: torch.Tensor, key: str | None, tokens) -> None:
        self._changed(row)
        self.host.copy_from_pool([row], self.pool, slots)
        if key is not None and self._writer is not None:
            self._writer.submit(self._write_row, row, self._generation[row], key, tokens)

    def _write_row(self, row: int, generation: int, key: str, tokens: list[int]) -> None:
        with self._lock:
            if self._generation[row] != generation:
                return  # (the row changed before its turn: lost, as on rank 0)
            tensors = self.host.row_tensors(row)
        self._write(key, tokens, tensors)

    def _write(self, key: str, tokens: list[int], tensors: list[torch.Tensor]) -> None:
        """(The writer thread.) A block whose write fails is lost here, which rank 0 learns
        when it is read (``CONFIRM``)."""
        try:
            self.disk.write(key, tokens, tensors)
        except Exception:  # noqa: BLE001 - the writer thread must go on
            logger.exception("writing a KV block to disk failed on rank %d", self.rank)

    def _fetch(self, key: str) -> None:
        if self.disk is None or key in self._reading:
            return
        self._reading[key] = self._readers.submit(self.disk.read_recorded, key)
        while len(self._reading) > self.host.capacity:  # (rank 0 failed to read these)
            self._reading.popitem(last=False)

    def _fetched(self, row: int, key: str) -> None:
        self._changed(row)
        found = self._reading.pop(key, None)
        if found is None and self._readers is not None:  # (not announced: read it now)
            found = self._readers.submit(self.disk.read_recorded, key)
        self._pending[row] = found

    def _resolve(self, row: int) -> None:
        """Puts a pending read into its row (a failed read marks the row bad)."""
        if row not in self._pending:
            return
        found = self._pending.pop(row)
        try:
            read = None if found is None else found.result()
        except Exception:  # noqa: BLE001 - a read that failed is a block this rank lacks
            logger.exception("reading a KV block from disk failed on rank %d", self.rank)
            read = None
        if read is None or len(read[0]) != self.block_tokens:
            self._bad.add(row)
            return
        self.host.write_row(row, read[1])

    def _load(self, rows: list[int], skip: int, slots: torch.Tensor) -> None:
        for row in rows:
            self._resolve(row)
            if row in self._bad:  # (rank 0 confirms every row read from disk before a load)
                logger.error("host row %d has no block on rank %d but is loaded", row,
                             self.rank)
        self.host.copy_into_pool(rows, self.pool, slots, skip)

    def held(self, rows: list[int]) -> list[bool]:
        """Whether this rank holds its share of each of ``rows`` (reads finished first)."""
        for row in rows:
            self._resolve(row)
        return [row not in self._bad for row in rows]

    def _confirm(self, rows: list[int], cpu_group) -> None:
        """This rank's flags, into the all-reduce whose minimum rank 0 acts on."""
        held = torch.tensor([int(flag) for flag in self.held(rows)], dtype=torch.int64)
        dist.all_reduce(held, op=dist.ReduceOp.MIN, group=cpu_group)

    def close(self) -> None:
        """Finishes the disk writes queued so far and closes the disk tier."""
        if self._writer is not None:
            self._readers.shutdown(wait=True)
            self._writer.shutdown(wait=True)
            self.disk.close()
            self._writer = self._readers = None
