"""The windowed radix cache (``radixlm/kv_cache/windowed_radix_tree.py``): matches cut back
to where the sliding window before them is held, inserts that give the tree back local KV,
local eviction that spares window-locked prefixes and keeps full KV."""

from __future__ import annotations

import random

import pytest
import torch

from radixlm.kv_cache.hybrid_pool import HybridAllocator
from radixlm.kv_cache.windowed_radix_tree import WindowedRadixCache

W, PAGE = 8, 4


def make_tree(page: int = PAGE, window: int = W) -> WindowedRadixCache:
    return WindowedRadixCache(HybridAllocator(512, 256, page), page, window)


def cache(tree: WindowedRadixCache, key: list[int]) -> torch.Tensor:
    """Caches ``key`` on fresh slots, as a finished request would; returns them."""
    slots = tree.allocator.alloc(len(key))
    assert tree.insert(key, slots) == 0
    return slots


def naive_usable(held: list[bool], window: int, page: int) -> int:
    """The longest page-aligned P whose W - 1 tokens before it are held, by a loop."""
    best = 0
    for end in range(0, len(held) + 1, page):
        if all(held[max(0, end - window + 1): end]):
            best = end
    return best


def test_a_match_whose_window_is_held_is_whole():
    tree = make_tree()
    key = list(range(32))
    slots = cache(tree, key)
    tree.allocator.release_local(slots[8:16])  # far behind the end's window
    match = tree.match_prefix(key)
    assert torch.equal(match.indices, slots)


def test_a_match_is_cut_back_to_where_its_window_is_complete():
    tree = make_tree()
    key = list(range(32))
    slots = cache(tree, key)
    tree.allocator.release_local(torch.cat([slots[8:16], slots[24:28]]))
    match = tree.match_prefix(key + [99])
    # 32 needs 25..31 and 28 needs 21..27 (24..27 dropped); 24 needs 17..23: held.
    assert len(match.indices) == 24
    assert torch.equal(match.indices, slots[:24])
    assert len(match.last_node.key) and match.last_node.value[-1] == slots[23]
    assert tree.total_size() == 32  # the cut keeps every token's full KV in the tree
    assert torch.equal(tree.match_inserted(key).indices, slots)


@pytest.mark.parametrize("page", [1, 4])
def test_usable_length_equals_a_naive_loop(page):
    rng = random.Random(page)
    tree = make_tree(page)
    for _ in range(50):
        n = rng.randrange(0, 16) * page
        slots = tree.allocator.alloc(n)
        drop = [p for p in range(n // page) if rng.random() < 0.3]
        for p in drop:
            tree.allocator.release_local(slots[p * page: (p + 1) * page])
        held = tree.allocator.local_held(slots).tolist()
        assert tree.usable_length(slots) == naive_usable(held, W, page)
        tree.allocator.free(slots)


def test_insert_gives_the_tree_back_the_local_kv_it_had_lost():
    tree = make_tree()
    key = list(range(16))
    old = cache(tree, key)
    tree.allocator.release_local(old)
    assert len(tree.match_prefix(key).indices) == 0
    mine = tree.allocator.alloc(16)  # a request that computed the same tokens again
    assert tree.insert(key, mine) == 16
    assert bool(tree.allocator.local_held(old).all())
    assert not bool(tree.allocator.local_held(mine).any())
    tree.allocator.free(mine)  # the caller frees its duplicates: full slots only now
    assert torch.equal(tree.match_prefix(key).indices, old)
    assert tree.allocator.local_available_size() == tree.allocator.local.size - 16


def test_local_eviction_spares_a_window_locked_prefix_and_keeps_full_kv():
    tree = make_tree()
    locked_key, other_key = list(range(32)), list(range(100, 132))
    locked, other = cache(tree, locked_key), cache(tree, other_key)
    node = tree.match_prefix(locked_key).last_node
    tree.inc_lock_ref(node)
    tree.lock_window(node)
    # The locked prefix keeps the pages of its last W - 1 tokens: 8 of its 32.
    assert tree.local_evictable_size() == 32 + 24
    freed = tree.evict_local(1000)
    assert freed == 32 + 24 and tree.local_evictable_size() == 0
    assert not bool(tree.allocator.local_held(other).any())
    assert tree.allocator.local_held(locked).tolist() == [False] * 24 + [True] * 8
    assert tree.total_size() == 64  # full KV stays
    assert len(tree.match_prefix(other_key).indices) == 0
    assert len(tree.match_prefix(locked_key).indices) == 32
    tree.unlock_window(node)
    tree.dec_lock_ref(node)
    assert tree.evict_local(1000) == 8
    assert tree.allocator.local_available_size() == tree.allocator.local.size
    assert tree.evict(64) == 64
    assert tree.allocator.available_size() == tree.allocator.size


def test_local_eviction_takes_the_least_recently_used_first():
    tree = make_tree()
    first, second = cache(tree, list(range(16))), cache(tree, list(range(50, 66)))
    tree.match_prefix(list(range(16)))  # touched: the second is now older
    assert tree.evict_local(16) == 16
    assert bool(tree.allocator.local_held(first).all())
    assert not bool(tree.allocator.local_held(second).any())


def test_a_window_lock_needs_a_lock_and_a_matching_unlock():
    tree = make_tree()
    key = list(range(16))
    cache(tree, key)
    node = tree.match_prefix(key).last_node
    with pytest.raises(ValueError, match="not locked"):
        tree.lock_window(node)
    with pytest.raises(ValueError, match="no window lock"):
        tree.unlock_window(node)
    tree.lock_window(tree.root)  # the empty prefix: nothing to keep
    tree.unlock_window(tree.root)


def test_a_split_above_a_window_locked_node_keeps_its_window_protected():
    tree = make_tree()
    key = list(range(32))
    slots = cache(tree, key)
    node = tree.match_prefix(key).last_node
    tree.inc_lock_ref(node)
    tree.lock_window(node)
    tree.match_prefix(list(range(28)) + [7, 7, 7, 7])  # splits the edge at 28
    tree.evict_local(1000)
    assert bool(tree.allocator.local_held(slots[-(W - 1):]).all())
    tree.unlock_window(node)
    tree.dec_lock_ref(node)
