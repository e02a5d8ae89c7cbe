"""The hierarchical prefix cache (``radixlm/kv_cache/hierarchical_cache.py``): write-back
and write-through, loads back into the device pool, namespaces, reset.

Every test runs over ``tests/hierarchical_rig.py``'s ``Rig``: real allocator, pool and
tiers, each request writing the KV a model would (``kv_of``, a hash of its prefix), so a
match or a load is checked against what a fresh computation would have written; every test
ends with the accounting balanced (``free + cached + held == pool``) and nothing protected
once no lock is held (the ``make_rig`` fixture).
"""

from __future__ import annotations

import pytest
import torch
from hierarchical_rig import (
    DIM,
    HEADS,
    LAYERS,
    prompt,
)

from radixlm.kv_cache.allocator import TokenToKVPoolAllocator
from radixlm.kv_cache.hierarchical_cache import HierarchicalCache
from radixlm.kv_cache.host_kv_blocks import HostKVBlocks
from radixlm.kv_cache.memory_pool import MHATokenToKVPool
from radixlm.kv_cache.radix_tree import RadixCache

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
