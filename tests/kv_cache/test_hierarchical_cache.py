"""The hierarchical prefix cache (``radixlm/kv_cache/hierarchical_cache.py``) over real pieces.

A small allocator and MHA pool (float32, CPU), the host tier and, where a test asks, a real
disk tier in a temporary directory. Every "request" writes at its slots the KV a model would:
a function of the whole token prefix up to each position and of the namespace (``kv_of``,
a chained hash), so any KV found in the pool, the host tier or a file can be checked against
what a fresh computation would have written. Wrong KV never appears: every test compares
what a match or a load returns with ``kv_of``; every test ends with the accounting balanced
(``free + cached + held == pool``) and nothing protected once no lock is held.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from mounts import tmpfs

from radixlm.kv_cache.allocator import TokenToKVPoolAllocator, pages_for
from radixlm.kv_cache.disk_kv_store import DiskKVStore, StoreIdentity
from radixlm.kv_cache.hierarchical_cache import HierarchicalCache
from radixlm.kv_cache.host_kv_blocks import HostKVBlocks
from radixlm.kv_cache.memory_pool import MHATokenToKVPool
from radixlm.kv_cache.radix_tree import RadixCache

LAYERS, HEADS, DIM = 2, 1, 4
VALUES = 2 * LAYERS * HEADS * DIM  # per token: K and V of every layer


# ---- the KV a model would compute -------------------------------------------------------------


@functools.lru_cache(maxsize=1 << 16)
def _digest(ns: str | None, prefix: tuple[int, ...]) -> bytes:
    above = _digest(ns, prefix[:-1]) if prefix else repr(ns).encode()
    if not prefix:
        return hashlib.blake2b(above, digest_size=2 * VALUES).digest()
    return hashlib.blake2b(above + prefix[-1].to_bytes(8, "little", signed=True),
                           digest_size=2 * VALUES).digest()


def kv_of(ns: str | None, tokens, start: int = 0) -> torch.Tensor:
    """(len(tokens) - start, VALUES) float32: the KV of positions ``start..`` of ``tokens``,
    each a function of the namespace and the whole prefix up to it (integers < 2**16, exact)."""
    tokens = tuple(tokens)
    rows = [torch.frombuffer(bytearray(_digest(ns, tokens[: i + 1])), dtype=torch.int16)
            for i in range(start, len(tokens))]
    if not rows:
        return torch.empty((0, VALUES))
    return torch.stack(rows).to(torch.float32)


def write_kv(pool: MHATokenToKVPool, slots: torch.Tensor, kv: torch.Tensor) -> None:
    for b, buffer in enumerate(pool.layer_buffers()):
        pool.write_rows(buffer, slots, kv[:, b * HEADS * DIM:(b + 1) * HEADS * DIM]
                        .reshape(-1, HEADS, DIM))


def read_kv(pool: MHATokenToKVPool, slots: torch.Tensor) -> torch.Tensor:
    return torch.cat([b.index_select(0, slots).reshape(len(slots), HEADS * DIM)
                      for b in pool.layer_buffers()], dim=1)


def block_kv(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A host or disk block (one tensor per pool buffer) as (block_tokens, VALUES)."""
    return torch.cat([t.reshape(t.shape[0], -1) for t in tensors], dim=1)


def assert_kv(pool, slots: torch.Tensor, ns: str | None, tokens, start: int = 0) -> None:
    got, expected = read_kv(pool, slots), kv_of(ns, tokens, start)
    assert torch.equal(got, expected), f"wrong KV for {len(tokens)} tokens in namespace {ns!r}"


# ---- a cache over real pieces, and requests that compute ---------------------------------------


class Rig:
    """A ``HierarchicalCache`` over a real allocator, MHA pool, host tier (and disk tier)."""

    def __init__(self, page: int = 1, block: int = 4, slots: int = 64, host_blocks: int = 32,
                 write_through: bool = False, min_load_tokens: int = 1,
                 disk_dir: Path | None = None, disk_bytes: int = 1 << 22):
        self.page, self.block = page, block
        self.allocator = TokenToKVPoolAllocator(slots, page)
        self.pool = MHATokenToKVPool(slots + page, LAYERS, HEADS, DIM, torch.float32, "cpu")
        self.tree = RadixCache(self.allocator, page)
        self.host = HostKVBlocks(self.pool, block, host_blocks)
        self.identity = StoreIdentity.of_pool(self.pool, model="test/tiny", tokenizer="tok-v1",
                                              page_size=page, block_tokens=block)
        self.disk = (DiskKVStore(disk_dir, self.identity, disk_bytes)
                     if disk_dir is not None else None)
        self.cache = HierarchicalCache(self.tree, self.pool, self.host, self.disk,
                                       self.identity.fingerprint(), write_through,
                                       min_load_tokens)
        self.held = 0  # slots held by requests outside the tree
        self.locked: list = []

    def serve(self, tokens, ns: str | None = None, load: bool = True,
              keep_locked: bool = False) -> tuple[int, int]:
        """Admits a request for ``tokens`` (loading from the lower tiers first when ``load``),
        checks the KV its match finds, computes the rest, caches it; returns (tokens loaded,
        tokens matched)."""
        tokens = list(tokens)
        loaded = self.cache.load_back(tokens, ns) if load else 0
        match = self.cache.match_prefix(tokens, ns)
        cached = len(match.indices)
        assert cached >= loaded
        assert_kv(self.pool, match.indices, ns, tokens[:cached])
        self.cache.inc_lock_ref(match.last_node)
        need = pages_for(len(tokens) - cached, self.page)
        if self.allocator.available_size() < need:
            self.cache.evict(need - self.allocator.available_size())
        fresh = self.allocator.alloc(len(tokens) - cached)
        write_kv(self.pool, fresh, kv_of(ns, tokens, cached))
        indices = torch.cat([match.indices, fresh])
        already = self.cache.insert(tokens, indices, ns)
        aligned = len(tokens) - len(tokens) % self.page
        self.allocator.free(indices[cached:already])
        self.allocator.free(indices[aligned:])
        if keep_locked:
            self.locked.append(match.last_node)
        else:
            self.cache.dec_lock_ref(match.last_node)
        return loaded, cached

    def lock(self, tokens, ns: str | None = None) -> None:
        """Locks the cached prefix of ``tokens`` as a running request would."""
        match = self.cache.match_prefix(list(tokens), ns)
        self.cache.inc_lock_ref(match.last_node)
        self.locked.append(match.last_node)

    def matched(self, tokens, ns: str | None = None) -> int:
        """How many tokens of ``tokens`` L1 holds, their KV checked."""
        match = self.cache.match_prefix(list(tokens), ns)
        assert_kv(self.pool, match.indices, ns, list(tokens)[: len(match.indices)])
        return len(match.indices)

    def evict_all(self) -> None:
        self.cache.evict(self.allocator.size)
        assert self.cache.evictable_size() == 0

    def drain(self) -> None:
        """Waits for the disk worker's queue (one thread: a no-op runs after what came before)."""
        if self.cache._worker is not None:
            self.cache._worker.submit(lambda: None).result()

    def host_block_is(self, tokens, ns: str | None, index: int) -> bool:
        """Whether the host tier holds block ``index`` of ``tokens`` with the right KV."""
        key = self.cache.block_keys(list(tokens), ns)[index]
        tensors = self.host.block_tensors(key)
        if tensors is None:
            return False
        end = (index + 1) * self.block
        assert torch.equal(block_kv(tensors), kv_of(ns, list(tokens)[:end], end - self.block))
        return True

    def scribble_free_slots(self) -> None:
        """Overwrites the KV of every free slot, so nothing found there later is a leftover."""
        free = self.allocator._page_slots(list(self.allocator._free_pages))
        for buffer in self.pool.layer_buffers():
            buffer[free] = float("nan")

    def check_accounting(self) -> None:
        assert (self.allocator.available_size() + self.cache.total_size() + self.held
                == self.allocator.size)
        assert self.cache.evictable_size() + self.cache.protected_size() == self.cache.total_size()
        if not self.locked:
            assert self.cache.protected_size() == 0


@pytest.fixture
def make_rig():
    """Builds rigs; after the test, each one's accounting must balance, its locks released."""
    rigs: list[Rig] = []

    def make(**options) -> Rig:
        rig = Rig(**options)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.check_accounting()
        for node in rig.locked:
            rig.cache.dec_lock_ref(node)
        rig.locked.clear()
        rig.check_accounting()
        rig.cache.close()


def prompt(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


# ---- write-back and write-through --------------------------------------------------------------


@pytest.mark.parametrize("page, block", [(1, 4), (4, 4), (4, 8)])
def test_eviction_writes_back_only_whole_blocks(make_rig, page, block):
    rig = make_rig(page=page, block=block)
    a = prompt(3 * block - page)  # two whole blocks and part of a third
    b = a[: block + page] + prompt(2 * block, start=5000)  # shares block 0, forks in block 1
    rig.serve(a)
    rig.serve(b)
    assert rig.host.stats().blocks == 0  # write-back: nothing copied until evicted
    rig.evict_all()
    assert rig.host_block_is(a, None, 0) and rig.host_block_is(a, None, 1)
    assert all(rig.host_block_is(b, None, i) for i in range(len(b) // block))
    keys = set(rig.cache.block_keys(a, None)) | set(rig.cache.block_keys(b, None))
    assert len(keys) < 2 + len(b) // block  # (b shares a's first block)
    assert rig.host.stats().blocks == len(keys)
    assert rig.cache.counters.write_backs == rig.host.stats().blocks
    assert rig.cache.stats()["host"]["tokens"] == rig.host.stats().blocks * block


def test_evicting_a_leaf_stores_the_blocks_ending_inside_it(make_rig):
    rig = make_rig(block=4)
    head = prompt(6)
    whole = head + prompt(6, start=2000)
    rig.serve(head)
    rig.serve(whole)  # the tree: [0, 6) -> [6, 12)
    assert rig.cache.evict(1) == 6  # the leaf [6, 12): blocks [4, 8) and [8, 12) end in it
    assert not rig.host_block_is(whole, None, 0)
    assert rig.host_block_is(whole, None, 1) and rig.host_block_is(whole, None, 2)
    assert rig.matched(whole) == 6
    rig.evict_all()
    assert rig.host_block_is(whole, None, 0) and rig.host.stats().blocks == 3


def test_write_through_stores_at_insert(make_rig):
    rig = make_rig(block=4, write_through=True)
    tokens = prompt(10)
    rig.serve(tokens)
    assert rig.host_block_is(tokens, None, 0) and rig.host_block_is(tokens, None, 1)
    assert rig.host.stats().blocks == 2 and rig.cache.counters.write_backs == 2
    longer = tokens + prompt(6, start=3000)
    rig.serve(longer)  # only the blocks past what was cached are new
    assert rig.host.stats().blocks == 4 and rig.host_block_is(longer, None, 3)
    rig.evict_all()
    assert rig.cache.counters.write_backs == 4  # eviction finds them stored
    assert rig.cache.stats()["write_policy"] == "write_through"


def test_a_block_size_that_splits_pages_is_refused():
    allocator = TokenToKVPoolAllocator(32, 4)
    pool = MHATokenToKVPool(36, LAYERS, HEADS, DIM, torch.float32, "cpu")
    with pytest.raises(ValueError, match="whole pages"):
        HierarchicalCache(RadixCache(allocator, 4), pool, HostKVBlocks(pool, 6, 4), None, "fp")


# ---- load_back ---------------------------------------------------------------------------------


@pytest.mark.parametrize("page, block", [(1, 4), (1, 8), (4, 4), (4, 8), (2, 8)])
def test_load_back_restores_exactly_the_evicted_prefix(make_rig, page, block):
    rig = make_rig(page=page, block=block)
    tokens = prompt(3 * block + page + 1)
    rig.serve(tokens)
    rig.evict_all()
    rig.scribble_free_slots()
    free = rig.allocator.available_size()
    aligned = len(tokens) - len(tokens) % page
    whole = aligned // block * block
    loaded, matched = rig.serve(tokens)
    assert loaded == matched == whole  # whole blocks only; the rest is recomputed
    assert rig.allocator.available_size() == free - aligned
    counters = rig.cache.counters
    assert (counters.loads, counters.host_hit_tokens) == (1, whole)
    assert rig.host.stats().bytes_loaded == whole // block * rig.host.block_bytes
    assert rig.matched(tokens) == aligned


@pytest.mark.parametrize("page", [1, 2])
def test_load_back_continues_a_match_that_ends_inside_a_block(make_rig, page):
    rig = make_rig(page=page, block=4)
    head = prompt(6)
    whole = head + prompt(8, start=2000)
    rig.serve(head)
    rig.serve(whole)
    rig.cache.evict(1)  # the leaf [6, 14)
    rig.scribble_free_slots()
    assert rig.matched(whole) == 6
    assert rig.cache.load_back(whole) == 6  # blocks [4, 8) from token 6, and [8, 12)
    assert rig.matched(whole) == 12
    assert rig.host.stats().bytes_loaded == rig.host.block_bytes * 6 // 4


def test_load_back_stops_at_the_first_block_the_host_lacks(make_rig):
    rig = make_rig(block=4, host_blocks=8)
    tokens = prompt(16)
    rig.serve(tokens)
    rig.evict_all()
    with rig.host._lock:  # drop block 2 only
        rig.host._free.append(rig.host._index.pop(rig.cache.block_keys(tokens, None)[2])[0])
    assert rig.cache.load_back(tokens) == 8
    assert rig.matched(tokens) == 8
    assert rig.cache.load_back(tokens) == 0  # block 2 missing: nothing past it is loaded


def test_a_run_shorter_than_min_load_tokens_is_recomputed(make_rig):
    rig = make_rig(block=4, min_load_tokens=8)
    tokens = prompt(6)
    rig.serve(tokens)
    rig.evict_all()
    free = rig.allocator.available_size()
    assert rig.cache.load_back(tokens) == 0
    assert rig.allocator.available_size() == free and rig.cache.total_size() == 0
    longer = prompt(9)
    rig.serve(longer)
    rig.evict_all()
    assert rig.cache.load_back(longer) == 8


def test_load_back_without_room_returns_zero_and_leaks_nothing(make_rig):
    rig = make_rig(block=4, slots=16)
    tokens = prompt(8)
    rig.serve(tokens)
    rig.evict_all()
    other = prompt(16, start=4000)
    rig.serve(other)
    rig.lock(other)  # the whole pool, locked by a running request
    assert rig.allocator.available_size() == 0
    assert rig.cache.load_back(tokens) == 0
    assert rig.cache.total_size() == rig.cache.protected_size() == 16
    rig.check_accounting()
    rig.cache.dec_lock_ref(rig.locked.pop())
    rig.evict_all()
    held = rig.allocator.alloc(12)  # a request holding slots outside the tree
    rig.held = 12
    assert rig.cache.load_back(tokens) == 0  # room for one block of the two: none loaded
    assert rig.cache.total_size() == 0 and rig.allocator.available_size() == 4
    rig.check_accounting()
    rig.allocator.free(held)
    rig.held = 0
    assert rig.cache.load_back(tokens) == 8 and rig.matched(tokens) == 8


def test_a_block_dropped_while_making_room_ends_the_load_and_frees_its_slots(make_rig):
    rig = make_rig(block=4, slots=12, host_blocks=3)
    a, b = prompt(8), prompt(8, start=7000)
    rig.serve(a)
    rig.evict_all()
    first, second = rig.cache.block_keys(a, None)
    rig.host.put_tensors(first, a[:4], rig.host.block_tensors(first))  # refreshes block 0
    rig.serve(b)  # 8 of the 12 slots
    rig.scribble_free_slots()
    assert rig.cache.load_back(a) == 4  # evicting b writes 2 blocks back: block 1 is dropped
    assert second not in rig.host and rig.host_block_is(b, None, 1)
    assert rig.matched(a) == 4
    assert rig.allocator.available_size() == 8
    rig.check_accounting()


def test_load_back_evicts_other_prefixes_to_make_room(make_rig):
    rig = make_rig(block=4, slots=16)
    first, second = prompt(12), prompt(12, start=7000)
    rig.serve(first)
    rig.evict_all()
    rig.serve(second)  # the tree holds 12 of 16 slots
    assert rig.cache.load_back(first) == 12
    assert rig.matched(first) == 12
    assert rig.matched(second) < 12
    assert rig.host_block_is(second, None, 2)  # written back by the eviction


def test_namespaces_never_cross(make_rig):
    rig = make_rig(block=4)
    tokens = prompt(8)
    rig.serve(tokens, "lora-a")
    rig.evict_all()
    for other in (None, "lora-b", ""):
        assert rig.cache.load_back(tokens, other) == 0
        assert rig.cache.prefetch(tokens, other) is None  # (no disk tier)
    rig.serve(tokens, "lora-b")  # the same tokens, other KV
    rig.evict_all()
    rig.scribble_free_slots()
    assert rig.cache.load_back(tokens, "lora-a") == 8
    assert rig.cache.load_back(tokens, "lora-b") == 8
    assert rig.matched(tokens, "lora-a") == rig.matched(tokens, "lora-b") == 8
    assert rig.matched(tokens, None) == 0


def test_reset_empties_l1_and_l2_but_not_the_disk(make_rig, tmp_path):
    rig = make_rig(block=4, disk_dir=tmp_path)
    tokens = prompt(8)
    rig.serve(tokens)
    rig.evict_all()
    rig.drain()
    assert rig.disk.stats().files == 2
    rig.cache.reset()
    rig.allocator.reset()
    assert rig.cache.total_size() == 0 and rig.host.stats().blocks == 0
    assert rig.cache.load_back(tokens) == 0
    assert rig.disk.stats().files == 2
    assert rig.cache.prefetch(tokens).result() == 8
    assert rig.cache.load_back(tokens) == 8
    assert rig.matched(tokens) == 8


# ---- the disk tier -----------------------------------------------------------------------------


def served_and_closed(make_rig, disk_dir):
    """A rig with a disk tier under ``disk_dir`` that served prompts a (13 tokens) and b
    (8, namespace "ns"), evicted them and closed (its queued disk writes finished):
    (the rig, a, b)."""
    first = make_rig(page=2, block=4, disk_dir=disk_dir)
    a, b = prompt(13), prompt(8, start=6000)
    first.serve(a)
    first.serve(b, "ns")
    first.evict_all()
    first.cache.close()
    return first, a, b


def test_a_restart_prefetches_from_disk_and_loads_exactly(make_rig, tmp_path):
    first, a, b = served_and_closed(make_rig, tmp_path)
    assert len(list(tmp_path.glob("*.safetensors"))) == 3 + 2
    assert first.cache.counters.disk_writes_queued == 5
    restarted = make_rig(page=2, block=4, disk_dir=tmp_path)
    assert restarted.disk.stats().files == 5
    assert restarted.cache.load_back(a) == 0  # not in host memory yet
    assert restarted.cache.prefetch(a).result() == 12
    assert restarted.cache.prefetch(b, "ns").result() == 8
    assert restarted.cache.counters.disk_hit_tokens == 20
    loaded, matched = restarted.serve(a)
    assert loaded == matched == 12
    assert restarted.serve(b, "ns") == (8, 8)
    assert restarted.cache.prefetch(a) is None  # all held above the disk now
    assert restarted.cache.prefetch(b, None) is None


def test_a_warm_start_reads_the_most_recent_blocks_into_the_host_tier(make_rig, tmp_path):
    _, a, b = served_and_closed(make_rig, tmp_path)
    restarted = make_rig(page=2, block=4, disk_dir=tmp_path)
    assert restarted.cache.warm_up().result() == 20  # every block: the tier holds them
    assert restarted.cache.counters.warmed_tokens == 20
    assert restarted.cache.prefetch(a) is None  # nothing left to read for it
    loaded, matched = restarted.serve(a)  # exact KV: serve checks it
    assert loaded == matched == 12
    assert restarted.serve(b, "ns") == (8, 8)
    empty = make_rig(page=2, block=4, disk_dir=tmp_path / "none")
    assert empty.cache.warm_up() is None


def slowed(read, seconds: float):
    """``read`` (a real disk tier's), taking ``seconds`` longer."""
    def slow(*args):
        time.sleep(seconds)
        return read(*args)
    return slow


def test_a_prompt_read_from_disk_during_a_long_warm_start_does_not_wait_for_it(make_rig,
                                                                                tmp_path):
    """Twelve prompts' 36 blocks on disk, each read taking 20 ms: the warm start takes
    about 0.2 s with 4 readers, but a prompt's own read, queued behind one group of its
    reads at most, is done long before it (it waited for all of it once)."""
    first = make_rig(page=2, block=4, disk_dir=tmp_path, host_blocks=64)
    prompts = [prompt(12, start=1000 * (i + 1)) for i in range(12)]
    for tokens in prompts:
        first.serve(tokens)
    first.evict_all()
    first.cache.close()
    restarted = make_rig(page=2, block=4, disk_dir=tmp_path, host_blocks=64)
    disk = restarted.disk
    assert disk.stats().files == 36
    for name in ("read", "read_recorded"):
        setattr(disk, name, slowed(getattr(disk, name), 0.02))
    warm = restarted.cache.warm_up()
    time.sleep(0.01)  # (the warm start has begun)
    # (the most recent prompt: the warm start reads it last)
    assert restarted.cache.prefetch(prompts[-1]).result(timeout=30) == 12
    assert not warm.done()
    assert warm.result(timeout=30) == 36 * 4 - 12  # (it skipped what the prompt read)
    assert restarted.serve(prompts[0]) == (12, 12) and restarted.serve(prompts[-1]) == (12, 12)


def test_loads_stop_once_measured_to_cost_more_than_recomputing(make_rig):
    rig = make_rig(block=4)
    a, b = prompt(8), prompt(8, start=3000)
    rig.serve(a)
    rig.serve(b)
    rig.evict_all()
    rig.cache.recompute_seconds_per_token = lambda: 0.0  # recomputing is free
    assert rig.cache.load_back(a) == 8  # loads not measured yet: the first one runs
    free = rig.allocator.available_size()
    assert rig.cache.load_back(b) == 0 and rig.allocator.available_size() == free
    rig.cache.recompute_seconds_per_token = lambda: 1e9
    assert rig.cache.load_back(b) == 8 and rig.matched(b) == 8


def test_prefetch_reads_only_what_l1_and_l2_lack(make_rig, tmp_path):
    rig = make_rig(block=4, disk_dir=tmp_path)
    tokens = prompt(16)
    rig.serve(tokens)
    rig.evict_all()
    rig.drain()
    rig.cache.reset()
    rig.allocator.reset()
    rig.serve(tokens[:4], load=False)  # block 0 in L1
    assert rig.cache.prefetch(tokens).result() == 12
    assert rig.disk.stats().read_hits == 3
    assert rig.cache.load_back(tokens) == 12 and rig.matched(tokens) == 16


def damage_truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def damage_overwrite(path: Path) -> None:
    path.write_bytes(bytes(range(256)) * (path.stat().st_size // 256 + 1))


def damage_same_size_garbage(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-8:] = b"\xff" * 8
    path.write_bytes(bytes(data))


def damage_delete(path: Path) -> None:
    path.unlink()


@pytest.mark.parametrize("damage", [damage_truncate, damage_overwrite,
                                    damage_same_size_garbage, damage_delete])
def test_a_damaged_file_under_a_live_cache_loads_only_the_whole_blocks(make_rig, tmp_path,
                                                                        caplog, damage):
    rig = make_rig(block=4, disk_dir=tmp_path)
    tokens = prompt(16)
    rig.serve(tokens)
    rig.evict_all()
    rig.drain()
    rig.cache.reset()
    rig.allocator.reset()
    keys = rig.cache.block_keys(tokens, None)
    damage(rig.disk.path_of(keys[2]))
    caplog.set_level(logging.WARNING)
    assert rig.cache.prefetch(tokens).result() == 8  # blocks 0 and 1
    assert any(r.levelno == logging.WARNING for r in caplog.records)
    assert keys[2] not in rig.host and keys[3] not in rig.host
    rig.scribble_free_slots()
    assert rig.serve(tokens) == (8, 8)
    assert not rig.disk.contains(keys[2])


def test_disk_writes_are_checked_bytes_of_the_evicted_kv(make_rig, tmp_path):
    rig = make_rig(page=4, block=8, disk_dir=tmp_path)
    tokens = prompt(24)
    rig.serve(tokens, "ns")
    rig.evict_all()
    rig.drain()
    for i, key in enumerate(rig.cache.block_keys(tokens, "ns")):
        block = tokens[i * 8:(i + 1) * 8]
        stored = rig.disk.read(key, block)
        assert torch.equal(block_kv(stored), kv_of("ns", tokens[:(i + 1) * 8], i * 8))


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 16 KiB tmpfs (a few block files), unmounted afterwards whatever happens."""
    with tmpfs(tmp_path / "mnt", "16k") as mount_point:
        yield mount_point


def test_a_full_disk_loses_blocks_with_a_warning_and_serving_goes_on(make_rig, small_tmpfs,
                                                                       caplog):
    caplog.set_level(logging.WARNING)
    rig = make_rig(block=4, slots=128, host_blocks=64, disk_dir=small_tmpfs,
                   disk_bytes=1 << 30)
    prompts = [prompt(16, start=1000 * (i + 1)) for i in range(8)]
    for tokens in prompts:
        rig.serve(tokens)
    rig.evict_all()
    rig.drain()
    disk = rig.disk.stats()
    assert disk.write_failures > 0 and 0 < disk.files < 32
    assert any("cannot write" in r.getMessage() for r in caplog.records
               if r.levelno == logging.WARNING)
    assert not [p for p in small_tmpfs.iterdir() if p.name.endswith(".tmp")]
    rig.scribble_free_slots()
    for tokens in prompts:  # every block is still in host memory
        assert rig.serve(tokens) == (16, 16)


# ---- a state machine against a reference model ------------------------------------------------

NAMESPACES = st.sampled_from([None, "lora-a"])


class HierarchicalCacheMachine(RuleBasedStateMachine):
    """Random requests (sequences sharing prefixes), locks, evictions, load-backs and
    prefetches against a reference model: the set of block-aligned prefixes ever computed.

    Each step checks that all KV in L1 and every host block is exactly ``kv_of`` its prefix
    (no wrong KV ever appears), that locked prefixes stay in L1 with the same slots, that the
    accounting balances, and, while the host tier has dropped nothing, that every prefix
    ever computed has its last block in L1 or in the host tier.
    """

    page = 1
    block = 4
    slots = 48
    host_blocks = 64
    max_len = 20
    alphabet = 3
    with_disk = False

    def __init__(self):
        super().__init__()
        self.directory = (tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
                          if self.with_disk else None)
        self.rig = Rig(page=self.page, block=self.block, slots=self.slots,
                       host_blocks=self.host_blocks, disk_dir=self.directory)
        self.inserted: list[tuple[str | None, tuple[int, ...]]] = []
        # Block-aligned prefixes computed so far, with the key of their last block:
        self.known: dict[tuple[str | None, tuple[int, ...]], str] = {}
        self.held: list = []  # (node, ns, prefix, slots)

    def draw_key(self, data) -> tuple[str | None, tuple[int, ...]]:
        ns, base = data.draw(NAMESPACES), ()
        if self.inserted and data.draw(st.integers(0, 3)) > 0:
            ns, earlier = data.draw(st.sampled_from(self.inserted))
            base = earlier[: data.draw(st.integers(0, len(earlier)))]
        tail = data.draw(st.lists(st.integers(0, self.alphabet - 1),
                                  max_size=self.max_len - len(base)))
        return ns, base + tuple(tail)

    def draw_known(self, data) -> tuple[str | None, tuple[int, ...]]:
        """Mostly a whole sequence served before (its blocks may be in any tier)."""
        if data.draw(st.integers(0, 3)) > 0:
            return data.draw(st.sampled_from(self.inserted))
        return self.draw_key(data)

    def after_step(self) -> None:
        if self.with_disk:
            self.rig.drain()  # the disk tier's contents then follow from the steps alone

    # -- rules --

    @rule(data=st.data(), load=st.booleans(), prefetch=st.booleans())
    def serve(self, data, load, prefetch):
        ns, tokens = self.draw_key(data)
        rig = self.rig
        if prefetch and self.with_disk:  # queued: read from disk first, as the scheduler does
            future = rig.cache.prefetch(list(tokens), ns)
            if future is not None:
                event("serve prefetched" if future.result() else "serve prefetched nothing")
        protected = rig.cache.protected_size()
        match = rig.cache.match_prefix(list(tokens), ns)
        rig.cache.inc_lock_ref(match.last_node)  # as the request will hold it
        room = rig.allocator.available_size() + rig.cache.evictable_size()
        rig.cache.dec_lock_ref(match.last_node)
        if pages_for(len(tokens) - len(match.indices), self.page) > room:
            return  # (would not fit beside the locked prefixes)
        before = rig.tree.cached_length(tokens, ns)
        loaded, cached = rig.serve(tokens, ns, load=load)
        event("serve loaded from the host tier" if loaded else "serve loaded nothing")
        assert cached == before + loaded
        assert rig.cache.protected_size() == protected
        self.inserted.append((ns, tokens))
        for end, key in zip(range(self.block, len(tokens) + 1, self.block),
                            rig.cache.block_keys(tokens, ns)):
            self.known[(ns, tokens[:end])] = key
        self.after_step()

    @precondition(lambda self: self.inserted)
    @rule(data=st.data())
    def lock(self, data):
        ns, earlier = data.draw(st.sampled_from(self.inserted))
        key = list(earlier[: data.draw(st.integers(0, len(earlier)))])
        match = self.rig.cache.match_prefix(key, ns)
        prefix = tuple(key[: len(match.indices)])
        assert_kv(self.rig.pool, match.indices, ns, prefix)
        self.rig.cache.inc_lock_ref(match.last_node)
        self.rig.locked.append(match.last_node)
        self.held.append((match.last_node, ns, prefix, match.indices.tolist()))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def unlock(self, data):
        node, *_ = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.rig.cache.dec_lock_ref(node)
        self.rig.locked.remove(node)

    @rule(num_tokens=st.integers(1, 24))
    def evict(self, num_tokens):
        rig = self.rig
        protected, free = rig.cache.protected_size(), rig.allocator.available_size()
        freed = rig.cache.evict(num_tokens)
        assert rig.allocator.available_size() == free + freed
        assert freed >= num_tokens or rig.cache.evictable_size() == 0
        assert rig.cache.protected_size() == protected
        self.after_step()

    @precondition(lambda self: self.inserted)
    @rule(data=st.data())
    def load_back(self, data):
        ns, tokens = self.draw_known(data)
        rig = self.rig
        before = rig.tree.cached_length(tokens, ns)
        loaded = rig.cache.load_back(list(tokens), ns)
        assert loaded >= 0
        event("load_back loaded" if loaded else "load_back loaded nothing")
        after = rig.matched(tokens, ns)  # the KV of the whole match is checked
        assert after == before + loaded
        if loaded:
            assert after % self.block == 0 and (ns, tokens[:after]) in self.known
        self.after_step()

    @precondition(lambda self: self.with_disk and self.inserted)
    @rule(data=st.data())
    def prefetch(self, data):
        ns, tokens = self.draw_known(data)
        future = self.rig.cache.prefetch(list(tokens), ns)
        if future is not None:
            read = future.result()
            event("prefetch read blocks" if read else "prefetch read nothing")
            assert read % self.block == 0
            if read:
                assert any((ns, tokens[:end]) in self.known
                           for end in range(read, len(tokens) + 1, self.block))

    # -- invariants --

    @invariant()
    def accounting_balances(self):
        self.rig.check_accounting()
        locked = [node for node, *_ in self.held if node is not self.rig.tree.root]
        assert (self.rig.cache.protected_size() == 0) == (not locked)

    @invariant()
    def l1_holds_only_the_right_kv(self):
        stack = [(child, ()) for child in self.rig.tree.root.children.values()]
        while stack:
            node, above = stack.pop()
            tokens = above + node.key
            assert torch.equal(read_kv(self.rig.pool, node.value),
                               kv_of(node.extra_key, tokens, len(above)))
            stack.extend((child, tokens) for child in node.children.values())

    @invariant()
    def host_holds_only_the_right_kv(self):
        host = self.rig.host
        with host._lock:
            stored = list(host._index.items())
        by_key = {key: found for found, key in self.known.items()}
        for key, (_, block_tokens) in stored:
            ns, prefix = by_key[key]  # every stored block was computed once
            assert prefix[-self.block:] == block_tokens
            assert self.rig.host_block_is(prefix, ns, len(prefix) // self.block - 1)

    @invariant()
    def locked_prefixes_stay_with_their_slots(self):
        for node, ns, prefix, slots in self.held:
            if node is self.rig.tree.root:
                continue
            tokens, values = self.rig.tree.prefix_of(node)
            assert node.parent is not None and tokens == prefix
            assert values.tolist() == slots and node.extra_key == ns
            assert_kv(self.rig.pool, values, ns, prefix)

    @invariant()
    def computed_blocks_are_in_l1_or_l2_until_the_host_drops(self):
        if self.rig.host.stats().dropped:
            event("the host tier dropped blocks")
            return
        for ns, prefix in self.known:
            if self.rig.tree.cached_length(prefix, ns) < len(prefix):
                assert self.rig.host_block_is(prefix, ns, len(prefix) // self.block - 1)

    def teardown(self):
        try:
            for node, *_ in self.held:
                self.rig.cache.dec_lock_ref(node)
            self.rig.locked.clear()
            self.held.clear()
            self.rig.check_accounting()
            assert self.rig.cache.protected_size() == 0
        finally:
            self.rig.cache.close()
            if self.directory is not None:
                shutil.rmtree(self.directory, ignore_errors=True)


class PagedHierarchicalCacheMachine(HierarchicalCacheMachine):
    page = 2
    block = 4
    slots = 48
    host_blocks = 6  # the host tier drops often
    alphabet = 2


class DiskHierarchicalCacheMachine(HierarchicalCacheMachine):
    page = 2
    block = 4
    slots = 32
    host_blocks = 4  # most blocks come back from disk
    with_disk = True


STATEFUL_SETTINGS = settings(max_examples=50, stateful_step_count=30, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])
TestHierarchicalCacheStateful = HierarchicalCacheMachine.TestCase
TestHierarchicalCacheStateful.settings = STATEFUL_SETTINGS
TestPagedHierarchicalCacheStateful = PagedHierarchicalCacheMachine.TestCase
TestPagedHierarchicalCacheStateful.settings = STATEFUL_SETTINGS
TestDiskHierarchicalCacheStateful = DiskHierarchicalCacheMachine.TestCase
TestDiskHierarchicalCacheStateful.settings = settings(STATEFUL_SETTINGS, max_examples=30)
