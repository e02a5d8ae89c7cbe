"""Tests of ``RadixCache.continuation`` (radixlm/kv_cache/radix_tree.py), the tokens cached
right after a key (speculative decoding's tree drafts), and of ``NoPrefixCache``'s: keys
ending inside an edge, at a node and inside a page; forks (the most recently used branch);
namespaces; no match; the ``max_tokens`` cut; and that a lookup changes nothing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.kv_cache.allocator import TokenToKVPoolAllocator
from radixlm.kv_cache.no_cache import NoPrefixCache
from radixlm.kv_cache.radix_tree import RadixCache, TreeNode


def make_cache(page_size: int = 1, size: int = 1024) -> tuple[TokenToKVPoolAllocator, RadixCache]:
    allocator = TokenToKVPoolAllocator(size, page_size)
    return allocator, RadixCache(allocator, page_size)


def put(allocator: TokenToKVPoolAllocator, cache: RadixCache, key: list[int],
        ns: str | None = None) -> None:
    """Inserts ``key`` as a finished request does: frees what the tree did not keep."""
    indices = allocator.alloc(len(key))
    cached = cache.insert(key, indices, ns)
    aligned = len(key) - len(key) % cache.page_size
    allocator.free(indices[:cached])
    allocator.free(indices[aligned:])


def snapshot(cache: RadixCache) -> list[tuple]:
    """Every node's identity, edge, parent and access time (and the clock)."""
    found, stack = [], [cache.root]
    while stack:
        node: TreeNode = stack.pop()
        found.append((node.node_id, node.key, node.parent and node.parent.node_id,
                      node.last_access_time, node.lock_ref))
        stack.extend(node.children.values())
    return sorted(found, key=lambda entry: entry[0]) + [("clock", cache._clock)]


# Pages of one token -----------------------------------------------------------------------


def test_a_key_ending_inside_an_edge_continues_to_the_edge_end():
    allocator, cache = make_cache()
    put(allocator, cache, [1, 2, 3, 4, 5, 6])
    assert cache.continuation([1, 2], 10) == [3, 4, 5, 6]
    assert cache.continuation([1, 2, 3, 4, 5], 10) == [6]


def test_a_key_ending_at_a_node_continues_down_the_latest_used_branch():
    allocator, cache = make_cache()
    put(allocator, cache, [1, 2, 3, 4, 5, 6])
    put(allocator, cache, [1, 2, 3, 7, 8])  # splits at 3; this branch is the newer
    assert cache.continuation([1, 2, 3], 10) == [7, 8]
    cache.match_prefix([1, 2, 3, 4, 5, 6])  # now the other one is
    assert cache.continuation([1, 2, 3], 10) == [4, 5, 6]
    assert cache.continuation([1], 10) == [2, 3, 4, 5, 6]  # across the node, same rule


def test_a_key_down_one_branch_continues_on_that_branch_whatever_was_used_last():
    allocator, cache = make_cache()
    put(allocator, cache, [1, 2, 3, 4, 5, 6])
    put(allocator, cache, [1, 2, 3, 7, 8])
    assert cache.continuation([1, 2, 3, 4], 10) == [5, 6]
    assert cache.continuation([1, 2, 3, 7], 10) == [8]


def test_a_continuation_follows_several_edges_down_to_a_leaf():
    allocator, cache = make_cache()
    put(allocator, cache, [1, 2, 3, 4, 5, 6, 7, 8])
    put(allocator, cache, [1, 2, 9])       # node at 2
    put(allocator, cache, [1, 2, 3, 4, 5, 0])  # node at 5, newest
    assert cache.continuation([1, 2], 10) == [3, 4, 5, 0]
    cache.match_prefix([1, 2, 9])
    assert cache.continuation([1], 10) == [2, 9]


@pytest.mark.parametrize("page_size", [1, 4])
def test_nothing_follows_an_uncached_key_or_a_whole_cached_sequence(page_size):
    allocator, cache = make_cache(page_size)
    put(allocator, cache, [1, 2, 3, 4, 5, 6, 7, 8])
    assert cache.continuation([9], 4) == []
    assert cache.continuation([1, 2, 9], 4) == []
    assert cache.continuation([1, 2, 3, 4, 5, 9], 4) == []
    assert cache.continuation([1, 2, 3, 4, 5, 6, 7, 8], 4) == []  # ends at a leaf
    assert cache.continuation([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == []  # beyond it
    assert cache.continuation([2, 3], 4) == []  # not a prefix


@pytest.mark.parametrize("page_size", [1, 4])
def test_max_tokens_cuts_the_continuation(page_size):
    allocator, cache = make_cache(page_size)
    put(allocator, cache, list(range(10, 30)))
    put(allocator, cache, list(range(10, 18)) + [50, 51, 52, 53])
    cache.match_prefix(list(range(10, 30)))
    for cut in range(0, 14):
        assert cache.continuation([10, 11], cut) == list(range(12, 30))[:cut]


@pytest.mark.parametrize("page_size", [1, 4])
def test_namespaces_share_no_continuation(page_size):
    allocator, cache = make_cache(page_size)
    put(allocator, cache, [1, 2, 3, 4, 5, 6, 7, 8], ns="tenant-a")
    put(allocator, cache, [1, 2, 3, 4, 9, 9, 9, 9], ns="tenant-b")
    assert cache.continuation([1, 2], 10) == []
    assert cache.continuation([1, 2], 10, "tenant-a") == [3, 4, 5, 6, 7, 8]
    assert cache.continuation([1, 2], 10, "tenant-b") == [3, 4, 9, 9, 9, 9]
    assert cache.continuation([1, 2, 3, 4, 5], 10, "tenant-b") == []
    assert cache.continuation([1, 2, 3, 4], 10, "tenant-c") == []


def test_an_empty_key_continues_in_its_own_namespace_only():
    allocator, cache = make_cache()
    put(allocator, cache, [1, 2, 3], ns="tenant-a")
    assert cache.continuation([], 10, "tenant-b") == []


# Pages of four tokens ---------------------------------------------------------------------


def test_with_pages_a_key_shorter_than_a_page_finds_the_edge_it_begins():
    allocator, cache = make_cache(4)
    put(allocator, cache, list(range(1, 13)))
    assert cache.continuation([1], 20) == list(range(2, 13))
    assert cache.continuation([1, 2, 3], 20) == list(range(4, 13))
    assert cache.continuation([1, 2, 3, 4, 5, 6], 20) == list(range(7, 13))  # mid-edge


def test_with_pages_only_the_aligned_part_of_a_sequence_is_continued():
    allocator, cache = make_cache(4)
    put(allocator, cache, list(range(1, 11)))  # 10 tokens: two pages cached
    assert cache.continuation([1, 2], 20) == list(range(3, 9))
    assert cache.continuation(list(range(1, 9)), 20) == []


def test_with_pages_a_fork_at_a_page_boundary_takes_the_latest_used_branch():
    allocator, cache = make_cache(4)
    put(allocator, cache, list(range(1, 13)))
    put(allocator, cache, list(range(1, 9)) + [20, 21, 22, 23])  # split at 8, newer
    assert cache.continuation(list(range(1, 9)), 20) == [20, 21, 22, 23]
    cache.match_prefix(list(range(1, 13)))
    assert cache.continuation(list(range(1, 9)), 20) == [9, 10, 11, 12]
    assert cache.continuation(list(range(1, 10)), 20) == [10, 11, 12]
    assert cache.continuation(list(range(1, 9)) + [20, 21], 20) == [22, 23]  # in a page


def test_with_pages_a_key_ending_inside_a_page_at_a_fork_takes_the_latest_matching_child():
    allocator, cache = make_cache(4)
    put(allocator, cache, [1, 2, 3, 4, 5, 6, 7, 8])
    put(allocator, cache, [1, 2, 3, 4, 5, 6, 9, 9])  # siblings by their first page
    put(allocator, cache, [1, 2, 3, 4, 0, 0, 0, 0])
    assert cache.continuation([1, 2, 3, 4, 5, 6], 10) == [9, 9]
    cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert cache.continuation([1, 2, 3, 4, 5, 6], 10) == [7, 8]
    assert cache.continuation([1, 2, 3, 4, 5], 10) == [6, 7, 8]
    assert cache.continuation([1, 2, 3, 4, 0], 10) == [0, 0, 0]


# Read-only --------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_continuation_splits_nothing_and_touches_no_access_time(page_size):
    allocator, cache = make_cache(page_size)
    put(allocator, cache, list(range(1, 17)))
    put(allocator, cache, list(range(1, 9)) + [40] * 8)
    put(allocator, cache, [7] * 8, ns="tenant-a")
    before = snapshot(cache)
    evictable, free = cache.evictable_size(), allocator.available_size()
    for key in ([1, 2, 3], list(range(1, 9)), list(range(1, 11)), [1, 2, 3, 4, 5, 6, 9],
                [7, 7], [40], []):
        for ns in (None, "tenant-a"):
            cache.continuation(key, 6, ns)
    assert snapshot(cache) == before
    assert (cache.evictable_size(), allocator.available_size()) == (evictable, free)
    assert list(cache._evict_queue) == sorted(cache._evict_queue,
                                              key=lambda n: (n.last_access_time, n.node_id))


def test_a_cache_that_keeps_nothing_continues_nothing():
    allocator = TokenToKVPoolAllocator(64, 1)
    cache = NoPrefixCache(allocator, 1)
    indices = allocator.alloc(4)
    cache.insert([1, 2, 3, 4], indices)
    assert cache.continuation([1, 2], 4) == []
    assert cache.continuation([], 4) == []


# Property: a continuation is what followed the key in some cached sequence -----------------


@pytest.mark.parametrize("page_size", [1, 4])
@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_a_continuation_is_the_rest_of_some_cached_sequence_extending_the_key(page_size, data):
    sequences = data.draw(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=14),
                                   min_size=1, max_size=6))
    allocator, cache = make_cache(page_size, size=512)
    for seq in sequences:
        put(allocator, cache, seq)
        if data.draw(st.booleans()):  # vary which branch was used last
            cache.match_prefix(data.draw(st.sampled_from(sequences)))
    cached = [tuple(s[: len(s) - len(s) % page_size]) for s in sequences]
    before = snapshot(cache)
    for _ in range(10):
        seq = data.draw(st.sampled_from(sequences))
        i = data.draw(st.integers(0, len(seq)))
        max_tokens = data.draw(st.integers(0, 12))
        key = tuple(seq[:i])
        found = cache.continuation(key, max_tokens)
        assert len(found) <= max_tokens
        # (an empty key is no context: nothing follows it)
        extended = i > 0 and max_tokens > 0 and any(len(c) > i and c[:i] == key
                                                     for c in cached)
        if not extended:
            assert found == [], (key, found)
        else:  # the rest of one cached sequence that extends the key, up to max_tokens
            assert any(c[:i] == key and list(c[i : i + max_tokens]) == found
                       for c in cached if len(c) > i), (key, found)
    assert snapshot(cache) == before


# Several branches (a draft's token tree) ---------------------------------------------------


def test_continuations_give_each_branch_below_the_key_latest_used_first():
    allocator, cache = make_cache()
    put(allocator, cache, [1, 2, 3, 4, 5, 6])
    put(allocator, cache, [1, 2, 3, 7, 8])
    put(allocator, cache, [1, 2, 9])
    assert cache.continuations([1, 2], 10, 5) == [[9], [3, 7, 8], [3, 4, 5, 6]]
    assert cache.continuations([1, 2], 2, 5) == [[9], [3, 7], [3, 4]]
    assert cache.continuations([1, 2], 10, 2) == [[9], [3, 7, 8]]
    assert cache.continuations([1], 3, 5) == [[2, 9], [2, 3, 7], [2, 3, 4]]
    assert cache.continuations([1, 2, 3, 4, 5, 6], 4, 5) == []
    assert cache.continuations([5], 4, 5) == []
    assert cache.continuation([1, 2], 10) == [9]  # the first of them


def test_continuations_change_nothing_and_keep_to_their_namespace():
    allocator, cache = make_cache()
    put(allocator, cache, [1, 2, 3], ns="a")
    put(allocator, cache, [1, 2, 4], ns="b")
    before = snapshot(cache)
    assert cache.continuations([1], 5, 5, extra_key="a") == [[2, 3]]
    assert cache.continuations([1], 5, 5) == []
    assert snapshot(cache) == before
    assert NoPrefixCache(allocator).continuations([1], 5, 5) == []


def test_a_key_ending_inside_a_page_continues_into_every_child_it_begins():
    allocator, cache = make_cache(page_size=2)
    put(allocator, cache, [1, 2, 3, 4, 5, 6])
    put(allocator, cache, [1, 2, 3, 7, 8, 9])  # pages (3, 4) and (3, 7): siblings
    put(allocator, cache, [1, 2, 5, 5])
    assert cache.continuations([1, 2, 3], 10, 5) == [[7, 8, 9], [4, 5, 6]]
    assert cache.continuations([1, 2, 3], 10, 1) == [[7, 8, 9]]
    assert cache.continuation([1, 2, 3], 2) == [7, 8]
