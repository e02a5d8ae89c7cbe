"""Tests of radixlm/kv_cache/radix_tree.py (and the NoPrefixCache baseline).

Table-driven cases for each behaviour of the contract; test_radix_tree_stateful.py drives
the cache through random operation sequences against a reference model.
"""

from __future__ import annotations

import pytest
import torch

from radixlm.kv_cache.allocator import TokenToKVPoolAllocator
from radixlm.kv_cache.no_cache import NoPrefixCache
from radixlm.kv_cache.radix_tree import RadixCache, TreeNode


def make_cache(page_size: int = 1, size: int = 1024) -> tuple[TokenToKVPoolAllocator, RadixCache]:
    allocator = TokenToKVPoolAllocator(size, page_size)
    return allocator, RadixCache(allocator, page_size)


def put(
    allocator: TokenToKVPoolAllocator, cache: RadixCache, key: list[int], ns: str | None = None
) -> tuple[torch.Tensor, int]:
    """Inserts ``key`` with fresh slots as the engine must: frees what the tree did not keep."""
    indices = allocator.alloc(len(key))
    cached = cache.insert(key, indices, ns)
    aligned = len(key) - len(key) % cache.page_size
    allocator.free(indices[:cached])
    allocator.free(indices[aligned:])
    return indices, cached


def path_tokens(node: TreeNode) -> tuple[int, ...]:
    parts = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return tuple(t for part in reversed(parts) for t in part)


# ---- table-driven cases -------------------------------------------------------------------

MATCH_CASES = [
    # (inserted keys, query, expected matched length)
    ([], [1, 2], 0),
    ([[1, 2, 3]], [1, 2, 3], 3),
    ([[1, 2, 3]], [1, 2, 3, 4], 3),
    ([[1, 2, 3]], [1, 2], 2),
    ([[1, 2, 3]], [2, 3], 0),
    ([[1, 2, 3]], [], 0),
    ([[1, 2, 3], [1, 2, 4]], [1, 2, 4, 5], 3),
    ([[1, 2, 3, 4, 5], [1, 2, 9]], [1, 2, 3, 4, 5], 5),
    ([[1, 2], [1, 2, 3, 4]], [1, 2, 3, 7], 3),
]


@pytest.mark.parametrize(("inserted", "query", "expected"), MATCH_CASES)
def test_match_returns_longest_cached_prefix_with_inserted_slots(inserted, query, expected):
    allocator, cache = make_cache()
    slot_of: dict[tuple[int, ...], int] = {}  # prefix -> slot of its last token
    for key in inserted:
        indices, _ = put(allocator, cache, key)
        for i in range(len(key)):
            slot_of.setdefault(tuple(key[: i + 1]), int(indices[i]))
    result = cache.match_prefix(query)
    assert len(result.indices) == expected
    assert result.indices.dtype == torch.int64
    assert result.indices.tolist() == [slot_of[tuple(query[: i + 1])] for i in range(expected)]
    assert path_tokens(result.last_node) == tuple(query[:expected])
    if expected == 0:
        assert result.last_node is cache.root


def test_match_inside_an_edge_splits_it_and_both_halves_stay_matchable():
    allocator, cache = make_cache()
    indices, _ = put(allocator, cache, [1, 2, 3, 4, 5, 6])
    result = cache.match_prefix([1, 2, 3, 9])
    assert result.last_node.key == (1, 2, 3)
    assert [child.key for child in result.last_node.children.values()] == [(4, 5, 6)]
    assert result.indices.tolist() == indices[:3].tolist()
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).indices.tolist() == indices.tolist()
    assert cache.total_size() == 6


INSERT_CASES = [
    # (already inserted, new key, expected already-cached count)
    ([], [1, 2, 3], 0),
    ([[1, 2, 3]], [1, 2, 3], 3),
    ([[1, 2, 3]], [1, 2, 3, 4, 5], 3),
    ([[1, 2, 3]], [1, 2], 2),
    ([[1, 2, 3]], [1, 2, 7], 2),
    ([[1, 2, 3]], [5, 2, 3], 0),
]


@pytest.mark.parametrize(("inserted", "key", "expected"), INSERT_CASES)
def test_insert_returns_already_cached_count(inserted, key, expected):
    allocator, cache = make_cache()
    for k in inserted:
        put(allocator, cache, k)
    before = cache.total_size()
    assert cache.insert(key, allocator.alloc(len(key))) == expected
    assert cache.total_size() == before + len(key) - expected


def test_request_life_cycle_frees_only_slots_the_request_allocated():
    allocator, cache = make_cache(size=64)
    put(allocator, cache, [1, 2])
    match = cache.match_prefix([1, 2, 3, 4])  # request A reuses [1, 2], computes [3, 4]
    cache.inc_lock_ref(match.last_node)
    row = torch.cat([match.indices, allocator.alloc(2)])
    put(allocator, cache, [1, 2, 3])  # meanwhile request B caches [1, 2, 3]
    cached = cache.insert([1, 2, 3, 4], row)
    assert cached == 3
    allocator.free(row[len(match.indices) : cached])  # A's own duplicate of token 3 only
    cache.dec_lock_ref(match.last_node)
    assert allocator.available_size() + cache.total_size() == allocator.size
    assert cache.match_prefix([1, 2, 3, 4]).indices[:2].tolist() == match.indices.tolist()


def test_insert_copies_the_callers_indices():
    allocator, cache = make_cache()
    indices = allocator.alloc(3)
    kept = indices.tolist()
    cache.insert([1, 2, 3], indices)
    indices.fill_(0)
    assert cache.match_prefix([1, 2, 3]).indices.tolist() == kept


def test_insert_rejects_mismatched_lengths():
    allocator, cache = make_cache()
    with pytest.raises(ValueError, match="indices"):
        cache.insert([1, 2, 3], allocator.alloc(2))


def test_page_size_4_aligns_match_and_insert_to_pages():
    allocator, cache = make_cache(page_size=4)
    key = list(range(10))
    _, cached = put(allocator, cache, key)
    assert cached == 0
    assert cache.total_size() == 8  # the 2-token tail is the caller's
    assert len(cache.match_prefix(key).indices) == 8
    assert len(cache.match_prefix(key[:7]).indices) == 4
    assert len(cache.match_prefix([0, 1, 2, 3, 4, 5, 6, 99]).indices) == 4  # mismatch in page 2
    assert len(cache.match_prefix([0, 1, 2]).indices) == 0
    assert cache.insert(key[:8], allocator.alloc(8)) == 8


@pytest.mark.parametrize("query", [[0, 1, 2, 3, 4, 5, 6, 99], [0, 1, 2, 3, 4, 5, 6, 99, 8]])
def test_page_size_4_mismatch_inside_a_page_matches_only_whole_pages(query):
    allocator, cache = make_cache(page_size=4)
    put(allocator, cache, list(range(8)))
    result = cache.match_prefix(query)
    assert len(result.indices) == 4 and result.last_node.key == (0, 1, 2, 3)
    _, cached = put(allocator, cache, query)
    assert cached == 4


def test_splitting_a_locked_edge_keeps_both_halves_locked():
    allocator, cache = make_cache()
    put(allocator, cache, [1, 2, 3, 4, 5, 6])
    node = cache.match_prefix([1, 2, 3, 4, 5, 6]).last_node
    cache.inc_lock_ref(node)
    upper = cache.match_prefix([1, 2, 3]).last_node
    assert upper.lock_ref == 1 and node.parent is upper
    assert cache.evict(100) == 0 and cache.protected_size() == 6
    cache.dec_lock_ref(node)
    assert cache.evictable_size() == 6 and cache.evict(100) == 6


def test_extra_key_namespaces_share_nothing():
    allocator, cache = make_cache()
    put(allocator, cache, [1, 2, 3], "tenant-a")
    assert len(cache.match_prefix([1, 2, 3]).indices) == 0
    assert len(cache.match_prefix([1, 2, 3], "tenant-b").indices) == 0
    assert len(cache.match_prefix([1, 2, 3], "tenant-a").indices) == 3
    _, cached = put(allocator, cache, [1, 2, 3, 4])
    assert cached == 0
    assert cache.total_size() == 7


def test_locked_path_is_never_evicted():
    allocator, cache = make_cache()
    put(allocator, cache, [1, 2, 3])
    put(allocator, cache, [7, 8])
    node = cache.match_prefix([1, 2, 3]).last_node
    cache.inc_lock_ref(node)
    assert (cache.protected_size(), cache.evictable_size()) == (3, 2)
    assert cache.evict(100) == 2
    assert len(cache.match_prefix([1, 2, 3]).indices) == 3
    cache.dec_lock_ref(node)
    assert (cache.protected_size(), cache.evictable_size()) == (0, 3)
    assert cache.evict(100) == 3
    assert cache.total_size() == 0


def test_lock_covers_ancestors_and_unlocking_twice_raises():
    allocator, cache = make_cache()
    put(allocator, cache, [1, 2, 3, 4])
    put(allocator, cache, [1, 2, 5])
    node = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.inc_lock_ref(node)
    assert node.parent.lock_ref == 1 and node.parent.key == (1, 2)
    assert cache.protected_size() == 4
    assert cache.evict(100) == 1  # only the unlocked sibling [5]
    cache.dec_lock_ref(node)
    with pytest.raises(ValueError, match="not locked"):
        cache.dec_lock_ref(node)


def test_evict_frees_exactly_the_evicted_slots_through_the_allocator():
    allocator, cache = make_cache(size=64)
    put(allocator, cache, [1, 2, 3, 4])
    put(allocator, cache, [5, 6])
    free_before = allocator.available_size()
    freed = cache.evict(3)
    assert freed == 4  # the LRU leaf [1, 2, 3, 4] goes whole
    assert allocator.available_size() == free_before + freed
    assert allocator.available_size() + cache.total_size() == allocator.size


def test_parent_becomes_an_evictable_leaf_after_its_children_go():
    allocator, cache = make_cache()
    put(allocator, cache, [1, 2, 3])
    put(allocator, cache, [1, 2, 4])
    assert cache.evict(1) == 1
    assert cache.evict(1) == 1
    assert cache.total_size() == 2
    assert cache.evict(1) == 2  # [1, 2] is now a leaf
    assert cache.total_size() == 0 and not cache.root.children


def test_eviction_takes_the_least_recently_used_leaf_first():
    allocator, cache = make_cache()
    put(allocator, cache, [1, 1, 1])  # oldest
    put(allocator, cache, [2, 2, 2])
    cache.match_prefix([1, 1, 1])  # now [2, 2, 2] is the least recently used
    assert cache.evict(1) == 3
    assert len(cache.match_prefix([1, 1, 1]).indices) == 3
    assert len(cache.match_prefix([2, 2, 2]).indices) == 0


def test_match_refreshes_access_time_along_the_whole_path():
    allocator, cache = make_cache()
    put(allocator, cache, [1, 2, 3])
    put(allocator, cache, [1, 2, 4])
    put(allocator, cache, [9, 9])
    other = cache.match_prefix([9, 9]).last_node
    node = cache.match_prefix([1, 2, 3]).last_node
    assert node.parent.last_access_time == node.last_access_time > other.last_access_time
    assert cache.evict(3) == 3  # [4] then [9, 9]; [1, 2, 3] was used last
    assert len(cache.match_prefix([1, 2, 3]).indices) == 3


def test_evicted_node_cannot_be_locked():
    allocator, cache = make_cache()
    put(allocator, cache, [1, 2])
    node = cache.match_prefix([1, 2]).last_node
    cache.evict(2)
    with pytest.raises(ValueError, match="evicted"):
        cache.inc_lock_ref(node)


def test_reset_empties_the_tree_without_freeing():
    allocator, cache = make_cache(size=16)
    put(allocator, cache, [1, 2, 3])
    cache.reset()
    assert cache.total_size() == 0 and not cache.root.children
    assert allocator.available_size() == 13


def test_pretty_print_mentions_keys_and_namespaces():
    allocator, cache = make_cache()
    put(allocator, cache, [11, 12, 13])
    put(allocator, cache, [11, 12, 99], "lora-x")
    text = cache.pretty_print()
    assert "[11, 12, 13]" in text and "[11, 12, 99]" in text and "lora-x" in text


def test_no_prefix_cache_keeps_nothing():
    allocator = TokenToKVPoolAllocator(16)
    cache = NoPrefixCache(allocator)
    indices = allocator.alloc(3)
    assert cache.insert([1, 2, 3], indices) == 0  # the caller frees all of indices
    result = cache.match_prefix([1, 2, 3])
    assert len(result.indices) == 0 and result.last_node is cache.root
    cache.inc_lock_ref(result.last_node)
    cache.dec_lock_ref(result.last_node)
    assert cache.evict(10) == 0
    assert (cache.evictable_size(), cache.protected_size(), cache.total_size()) == (0, 0, 0)
    assert allocator.available_size() == 13  # insert freed nothing
