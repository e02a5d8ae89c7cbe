"""The hierarchical prefix cache: the radix tree (L1, the device pool) over a host tier (L2)
and an optional disk tier (L3) that outlives the server.

Tiers. L1 is ``RadixCache`` as ever: the tree of token prefixes whose KV is in the device
pool, with its locks and LRU eviction. Below it, KV is kept in blocks of ``block_tokens``
tokens, keyed by a hash of the whole prefix up to the block's end (its namespace and the
model's identity included: ``disk_kv_store.chained_block_keys``). A chain of keys is a
path of the same tree: block i's key determines every token before it, so "which tier can
supply the next tokens of this prompt" is a walk down the chain, block by block: L2
(``HostKVBlocks``, host memory, LRU) and L3 (``DiskKVStore``, files, LRU by capacity).

Movement.
- L1 to L2: when the tree evicts a leaf (``RadixCache.on_evict``), the blocks ending inside
  it are copied to the host tier first (write-back, the default), unless stored already;
  with ``write_through`` every block is copied as soon as it enters the tree (``insert``).
- L2 to L3: every block that enters the host tier from the device is written to disk too,
  by a worker thread (the write policy of the disk tier is write-through, so that a
  restarted server finds what the last one computed); a full or read-only disk loses
  the block, with a warning, and serving goes on.
- L3 to L2: ``prefetch``, called when a request is queued, reads the blocks its prompt
  continues with on disk (after what L1 and L2 hold) into the host tier on the worker
  thread; the scheduler lets the request wait (others run) until that is done. At
  start-up ``warm_up`` reads the most recently used blocks into the host tier in the
  background, so that a restarted server's first requests need no disk read.
- L2 to L1: ``load_back``, called when a request is admitted, allocates device slots for
  the blocks after its L1 match that the host tier holds in a row, copies them in and
  inserts them into the tree, so the request's match then covers them. A run shorter than
  ``min_load_tokens`` is left to recompute, and so is any run once loads are measured to
  cost more a token than the prefill does (``recompute_seconds_per_token``, the
  scheduler's measured prefill pace; loads are timed as they run).

Tensor parallelism: the tiers exist on rank 0, over its share of the KV; ``host.mirror``
(a ``TierMirror``) has the other ranks copy their shares to and from the same host rows and
write and read their own files under the same keys. A run of rows filled from disk is
loaded only once every rank confirmed it holds its share (``HostKVBlocks.confirmed_run``);
a block some rank lacks is dropped from the host tier and from rank 0's disk.

Invariants: the tree's accounting is the radix tree's (loaded KV enters it as any
request's KV does: ``free + cached + held == pool``); a block is only ever stored whole in a
tier; the eviction hook never raises (a failed write-back loses the block from the lower
tiers, not the request); nothing here reads a file's bytes before ``DiskKVStore`` has
checked them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass

import torch

from radixlm.kv_cache.base import CacheNode, MatchResult, PrefixCache
from radixlm.kv_cache.disk_kv_store import DiskKVStore
from radixlm.kv_cache.host_kv_blocks import HostKVBlocks
from radixlm.kv_cache.kv_block_format import chained_block_keys
from radixlm.kv_cache.radix_tree import RadixCache, TreeNode

logger = logging.getLogger(__name__)

DISK_READERS = 4
"""Threads reading one prompt's blocks from disk side by side."""
LOAD_COST_DECAY = 0.8
"""Weight of the past in the running time a token's load takes."""


@dataclass
class TierCounters:
    host_hit_tokens: int = 0
    """Tokens loaded from the host tier into L1 (blocks prefetched from disk included)."""
    disk_hit_tokens: int = 0
    """Tokens read from the disk tier into the host tier (warm-up included)."""
    loads: int = 0
    load_seconds: float = 0.0
    """Host time of the loads into L1 (issuing the copies; on CUDA they run on)."""
    disk_read_seconds: float = 0.0
    warmed_tokens: int = 0
    """Tokens read from disk into the host tier at start-up (``warm_up``)."""
    write_backs: int = 0
    """Blocks copied from L1 to the host tier."""
    disk_writes_queued: int = 0
    rank_misses: int = 0
    """Blocks read from disk that another tensor-parallel rank lacked (dropped, recomputed)."""


class HierarchicalCache(PrefixCache):
    """A ``PrefixCache`` whose evicted prefixes live on in host memory and on disk."""

    keeps_inserted = True
    matches_stay_valid = False  # load_back may evict to make room

    def __init__(self, tree: RadixCache, pool, host: HostKVBlocks, disk: DiskKVStore | None,
                 fingerprint: str, write_through: bool = False, min_load_tokens: int = 1):
        """``pool``: the device pool of ``tree``'s slots; ``fingerprint``: the model's
        identity, in every block key (the disk tier's, where there is one)."""
        if host.block_tokens % tree.page_size:
            raise ValueError(f"blocks of {host.block_tokens} tokens do not hold whole pages "
                             f"of {tree.page_size}")
        self.tree = tree
        self.page_size = tree.page_size
        self.pool = pool
        self.host = host
        self.disk = disk
        self.block_tokens = host.block_tokens
        self.fingerprint = fingerprint
        self.write_through = write_through
        self.min_load_tokens = min_load_tokens
        self.counters = TierCounters()
        self.recompute_seconds_per_token: Callable[[], float | None] = lambda: None
        """The measured prefill time of a prompt token (None: not measured yet)."""
        self._load_seconds_per_token: float | None = None
        self._worker = ThreadPoolExecutor(1, "radixlm-kv-disk") if disk is not None else None
        """Writes blocks to disk, in order."""
        self._prefetcher = (ThreadPoolExecutor(1, "radixlm-kv-prefetch")
                            if disk is not None else None)
        """Runs each prompt's read (``_read_blocks``), apart from the writes."""
        self._readers = (ThreadPoolExecutor(DISK_READERS, "radixlm-kv-read")
                         if disk is not None else None)
        """Read a prompt's blocks side by side (file reads and checksums free the GIL)."""
        self._warmer = ThreadPoolExecutor(1, "radixlm-kv-warm") if disk is not None else None
        """Runs ``warm_up``'s reads, apart from the prompts' (which pass it: see there)."""
        self._closing = False
        tree.on_evict = self._write_back

    # The radix tree's interface (L1) -------------------------------------------------------

    def match_prefix(self, key: Sequence[int], extra_key: str | None = None) -> MatchResult:
        return self.tree.match_prefix(key, extra_key)

    def insert(self, key: Sequence[int], indices: torch.Tensor,
               extra_key: str | None = None) -> int:
        cached = self.tree.insert(key, indices, extra_key)
        if self.write_through:
            key = tuple(key.tolist() if isinstance(key, torch.Tensor) else key)
            self._store(key, indices, extra_key, after=cached)
        return cached

    def inc_lock_ref(self, node: CacheNode) -> None:
        self.tree.inc_lock_ref(node)

    def dec_lock_ref(self, node: CacheNode) -> None:
        self.tree.dec_lock_ref(node)

    def evict(self, num_tokens: int) -> int:
        return self.tree.evict(num_tokens)

    def evictable_size(self) -> int:
        return self.tree.evictable_size()

    def protected_size(self) -> int:
        return self.tree.protected_size()

    def continuations(self, key: Sequence[int], max_tokens: int, max_branches: int,
                      extra_key: str | None = None) -> list[list[int]]:
        return self.tree.continuations(key, max_tokens, max_branches, extra_key)

    def reset(self) -> None:
        """Empties L1 and the host tier; the disk tier keeps its blocks (it outlives
        servers: flushing the cache does not erase them)."""
        self.tree.reset()
        self.host.clear()

    def pretty_print(self) -> str:
        return self.tree.pretty_print()

    # Between the tiers -------------------------------------------------------------------------

    def block_keys(self, tokens: Sequence[int], extra_key: str | None) -> list[str]:
        return chained_block_keys(self.fingerprint, self.block_tokens, tokens, extra_key)

    def load_back(self, key: Sequence[int], extra_key: str | None = None) -> int:
        """Loads into L1 the host tier's blocks that continue ``key``'s cached prefix, in a
        row; returns how many tokens the prefix grew by (0: nothing worth loading, or no
        room in the device pool)."""
        key = tuple(key)
        match = self.tree.match_prefix(key, extra_key)
        cached, size = len(match.indices), self.block_tokens
        keys = self.block_keys(key, extra_key)
        first = cached // size
        run, lost = self.host.confirmed_run(keys[first:])
        for lost_key in lost:  # (another rank lacks it: of no use on disk either)
            self.disk.delete(lost_key)
        self.counters.rank_misses += len(lost)
        end = (first + run) * size
        if end - cached < max(self.min_load_tokens, 1) or not self._load_pays():
            return 0
        started = time.perf_counter()
        slots = self._slots_for(match, end - cached)
        if slots is None:
            return 0
        # (fewer than ``run`` blocks if some were dropped meanwhile: the disk worker made room)
        loaded = self.host.load_run_into_pool(keys[first : first + run], self.pool, slots,
                                              skip=cached - first * size)
        done = (first + loaded) * size if loaded else cached
        if done < end:
            self.tree.allocator.free(slots[done - cached :])
        if done == cached:
            return 0
        already = self.tree.insert(key[:done], torch.cat([match.indices, slots[: done - cached]]),
                                   extra_key)
        if already > cached:  # (nothing else inserts meanwhile; kept for the accounting)
            self.tree.allocator.free(slots[: already - cached])
        seconds = time.perf_counter() - started
        counters = self.counters
        counters.loads += 1
        counters.host_hit_tokens += done - cached
        counters.load_seconds += seconds
        per_token = seconds / (done - cached)
        known = self._load_seconds_per_token
        self._load_seconds_per_token = per_token if known is None else (
            LOAD_COST_DECAY * known + (1 - LOAD_COST_DECAY) * per_token)
        return done - cached

    def _load_pays(self) -> bool:
        """Whether loading a token costs less than recomputing it, as measured so far
        (yes until both are measured)."""
        recompute = self.recompute_seconds_per_token()
        load = self._load_seconds_per_token
        return recompute is None or load is None or load < recompute

    def prefetch(self, key: Sequence[int], extra_key: str | None = None) -> Future | None:
        """Starts reading from disk into the host tier the blocks that continue ``key``
        after what L1 and L2 hold (in a row); None when there is nothing to read."""
        if self.disk is None:
            return None
        key = tuple(key)
        keys = self.block_keys(key, extra_key)
        first = self.tree.cached_length(key, extra_key) // self.block_tokens
        wanted = []
        for block in range(first, len(keys)):
            if keys[block] in self.host:
                continue
            if not self.disk.contains(keys[block]):
                break
            start = block * self.block_tokens
            wanted.append((keys[block], key[start : start + self.block_tokens]))
        if not wanted:
            return None
        if self.host.mirror is not None:
            self.host.mirror.fetching([block_key for block_key, _ in wanted])
        return self._prefetcher.submit(self._read_blocks, wanted)

    def warm_up(self) -> Future | None:
        """Starts reading the disk tier's most recently used blocks into the host tier (as
        many as it holds, the most recent last, so they stay), so that a restarted
        server's first requests find them in host memory; None without a disk tier.

        A request that comes meanwhile does not wait for the warm-up: the warm-up gives the
        readers ``DISK_READERS`` blocks at a time, so a prompt's own reads (``prefetch``)
        are queued behind one such group at most, and it skips blocks they brought in.
        (With tensor parallelism the other ranks read a warm block once rank 0 has it.)"""
        if self.disk is None:
            return None
        keys = self.disk.recent_keys(self.host.capacity)[::-1]
        return self._warmer.submit(self._warm_blocks, keys) if keys else None

    def stats(self) -> dict:
        """Per-tier occupancy and traffic (``/get_server_info``, ``/metrics``)."""
        host = self.host.stats()
        found = {"block_tokens": self.block_tokens,
                 "write_policy": "write_through" if self.write_through else "write_back",
                 "device_tokens": self.tree.total_size(),
                 "host": asdict(host), "disk": None, **asdict(self.counters)}
        found["host"]["tokens"] = host.blocks * self.block_tokens
        if self.disk is not None:
            found["disk"] = asdict(self.disk.stats())
        return found

    def close(self) -> None:
        """Writes to disk the blocks only the device pool holds (with write-back, the
        prefixes in use to the end, often the most shared, were never evicted), finishes
        the writes queued so far, and closes the disk tier: a restarted server finds every
        whole block this one computed (as the disk's capacity allows)."""
        if self._worker is None:
            return
        worker, self._worker = self._worker, None  # (later blocks reach the host tier only)
        self._closing = True  # (the warm-up stops after its current group)
        self._warmer.shutdown(wait=True)
        self._prefetcher.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        worker.shutdown(wait=True)
        try:
            self._write_device_blocks()
        finally:
            self.disk.close()
            if self.host.mirror is not None:
                self.host.mirror.close()

    def _write_device_blocks(self) -> None:
        """Every whole block of the tree not on disk yet, straight from the device pool."""
        size, stack = self.block_tokens, list(self.tree.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
                continue
            tokens, slots = self.tree.prefix_of(node)  # a leaf: its whole prefix
            for block, key in enumerate(self.block_keys(tokens, node.extra_key)):
                if self.disk.contains(key):
                    continue
                rows = slots[block * size : (block + 1) * size]
                block_tokens = tokens[block * size : (block + 1) * size]
                tensors = [buffer.index_select(0, rows).cpu()
                           for buffer in self.pool.layer_buffers()]
                if self.disk.write(key, block_tokens, tensors) and self.host.mirror:
                    self.host.mirror.device_written(key, block_tokens, rows)

    # Internals ---------------------------------------------------------------------------------

    def _slots_for(self, match: MatchResult, count: int) -> torch.Tensor | None:
        """``count`` fresh device slots, evicting from L1 (never ``match``'s prefix)."""
        allocator = self.tree.allocator
        self.tree.inc_lock_ref(match.last_node)
        try:
            shortfall = count - allocator.available_size()
            if shortfall > 0:
                self.tree.evict(shortfall)
            if allocator.available_size() < count:
                return None
            return allocator.alloc(count)
        finally:
            self.tree.dec_lock_ref(match.last_node)

    def _write_back(self, leaf: TreeNode) -> None:
        """``RadixCache.on_evict``: the blocks ending inside ``leaf`` go to the host tier
        (never raises: a block that fails is only lost to the lower tiers)."""
        try:
            tokens, slots = self.tree.prefix_of(leaf)
            self._store(tokens, slots, leaf.extra_key, after=len(tokens) - len(leaf.key))
        except Exception:  # noqa: BLE001 - the eviction itself must go on
            logger.exception("writing evicted KV to the host tier failed; it is recomputed "
                             "when needed")

    def _store(self, tokens: tuple[int, ...], slots: torch.Tensor, extra_key: str | None,
               after: int) -> None:
        """Copies the blocks of ``tokens`` that end past token ``after`` into the host tier
        (and queues them for the disk)."""
        size = self.block_tokens
        keys = self.block_keys(tokens, extra_key)
        first = min(after // size, len(keys))  # (the first block ending past ``after``)
        blocks = [(key, tokens[block * size : (block + 1) * size],
                   self._worker is not None and not self.disk.contains(key))
                  for block, key in enumerate(keys[first:], first)]
        if not blocks:
            return
        stored = self.host.put_run_from_pool(blocks, self.pool,
                                             slots[first * size : len(keys) * size])
        for (key, block_tokens, to_disk), now in zip(blocks, stored):
            if now:
                self.counters.write_backs += 1
                if to_disk:
                    self.counters.disk_writes_queued += 1
                    self._worker.submit(self._write_block, key, block_tokens)

    def _write_block(self, key: str, tokens: tuple[int, ...]) -> None:
        tensors = self.host.block_tensors(key)
        if tensors is not None:  # (dropped from the host tier before its turn: lost)
            self.disk.write(key, tokens, tensors)

    def _warm_blocks(self, keys: list[str]) -> int:
        """Reads ``keys`` (tokens unknown: their headers') into the host tier."""
        started, read = time.perf_counter(), 0
        for first in range(0, len(keys), DISK_READERS):
            if self._closing:
                break
            group = [key for key in keys[first : first + DISK_READERS] if key not in self.host]
            for found, key in zip(self._readers.map(self.disk.read_recorded, group), group):
                if found is not None and key not in self.host:
                    tokens, tensors = found
                    self.host.put_tensors(key, tokens, tensors)
                    read += len(tokens)
        self.counters.warmed_tokens += read
        self.counters.disk_hit_tokens += read
        self.counters.disk_read_seconds += time.perf_counter() - started
        return read

    def _read_blocks(self, wanted: list[tuple[str, tuple[int, ...]]]) -> int:
        """Reads blocks from disk into the host tier (``DISK_READERS`` at a time), up to the
        first one missing or failing its checks (those after it cannot be used: the
        chain of the prompt's blocks breaks there); returns how many tokens came in."""
        started, read = time.perf_counter(), 0
        found = self._readers.map(lambda block: self.disk.read(*block), wanted)
        for (key, tokens), tensors in zip(wanted, found):
            if tensors is None:
                break
            self.host.put_tensors(key, tokens, tensors)
            read += len(tokens)
        self.counters.disk_hit_tokens += read
        self.counters.disk_read_seconds += time.perf_counter() - started
        return read
