"""Tests of radixlm/radix_cache/radix_tree.py (and the NoPrefixCache baseline).

Table-driven cases for each behaviour of the contract, then a hypothesis state machine that
drives the cache with the real allocator against a reference model: a dict from every cached
(namespace, page-aligned prefix) to the KV slots of its last page, with access times and lock
counts kept per prefix, independent of the tree's own bookkeeping.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixlm.radix_cache.allocator import TokenToKVPoolAllocator
from radixlm.radix_cache.no_cache import NoPrefixCache
from radixlm.radix_cache.radix_tree import RadixCache, TreeNode


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


def test_match_bumps_hit_counts_along_the_path():
    allocator, cache = make_cache()
    put(allocator, cache, [1, 2, 3])
    cache.match_prefix([1, 2, 3])
    node = cache.match_prefix([1, 2, 3]).last_node
    assert node.hit_count == 2


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


# ---- stateful test against a reference model ---------------------------------------------

NAMESPACES = st.sampled_from([None, "lora-a"])


class RadixCacheMachine(RuleBasedStateMachine):
    """Random inserts, matches, locks, unlocks and evictions, checked against a model."""

    page_size = 1
    num_pages = 40
    max_len = 12
    alphabet = 4

    def __init__(self):
        super().__init__()
        self.allocator = TokenToKVPoolAllocator(self.num_pages * self.page_size, self.page_size)
        self.cache = RadixCache(self.allocator, self.page_size)
        # Keyed by (ns, prefix) with len(prefix) a positive multiple of page_size:
        self.slots: dict[tuple, list[int]] = {}  # the KV slots of the prefix's last page
        self.touched: dict[tuple, int] = {}  # model tick of the prefix's last use
        self.locks: dict[tuple, int] = {}  # locks held on the prefix or an extension of it
        self.held: list[tuple[TreeNode, str | None, tuple[int, ...]]] = []
        self.inserted: list[tuple[int, ...]] = []
        self.tick = 0

    # -- model helpers --

    def draw_key(self, data) -> tuple[int, ...]:
        """Mostly a cut of an inserted key plus a new tail (so prefixes collide, inside pages
        too), sometimes a fresh key."""
        base: tuple[int, ...] = ()
        if self.inserted and data.draw(st.integers(0, 3)) > 0:
            earlier = data.draw(st.sampled_from(self.inserted))
            base = earlier[: data.draw(st.integers(0, len(earlier)))]
        token = st.integers(0, self.alphabet - 1)
        tail = data.draw(st.lists(token, max_size=self.max_len - len(base)))
        return base + tuple(tail)

    def model_match_len(self, ns, key) -> int:
        n, p = 0, self.page_size
        while n + p <= len(key) and (ns, key[: n + p]) in self.slots:
            n += p
        return n

    def page_ends(self, start: int, end: int) -> range:
        return range(start + self.page_size, end + 1, self.page_size)

    def model_slots(self, ns, key, n) -> list[int]:
        return [s for e in self.page_ends(0, n) for s in self.slots[(ns, key[:e])]]

    def model_touch(self, ns, key, n) -> None:
        self.tick += 1
        for e in self.page_ends(0, n):
            self.touched[(ns, key[:e])] = self.tick

    def tree_nodes(self):
        """(node, ns, tokens up to the node's end, start offset) for every non-root node."""
        stack = [(child, ()) for child in self.cache.root.children.values()]
        while stack:
            node, above = stack.pop()
            tokens = above + tuple(node.key)
            yield node, node.extra_key, tokens, len(above)
            stack.extend((child, tokens) for child in node.children.values())

    # -- rules --

    @rule(data=st.data(), ns=NAMESPACES)
    def insert(self, data, ns):
        key = self.draw_key(data)
        need = -(-len(key) // self.page_size) * self.page_size
        if self.allocator.available_size() < need:
            self.evict_and_check(need - self.allocator.available_size())
        if self.allocator.available_size() < need:
            return
        indices = self.allocator.alloc(len(key))
        aligned = len(key) - len(key) % self.page_size
        expected = self.model_match_len(ns, key)
        cached = self.cache.insert(key, indices, ns)
        assert cached == expected
        if aligned:
            self.inserted.append(key)
        self.allocator.free(indices[:cached])
        self.allocator.free(indices[aligned:])
        for e in self.page_ends(cached, aligned):
            self.slots[(ns, key[:e])] = indices[e - self.page_size : e].tolist()
        self.model_touch(ns, key, aligned)

    def match_and_check(self, key, ns):
        n = self.model_match_len(ns, key)
        result = self.cache.match_prefix(key, ns)
        assert result.indices.tolist() == self.model_slots(ns, key, n)
        assert path_tokens(result.last_node) == key[:n]
        assert (result.last_node is self.cache.root) == (n == 0)
        self.model_touch(ns, key, n)
        return result.last_node, key[:n]

    @rule(data=st.data(), ns=NAMESPACES)
    def match(self, data, ns):
        self.match_and_check(self.draw_key(data), ns)

    @precondition(lambda self: self.inserted)
    @rule(data=st.data(), ns=NAMESPACES)
    def lock(self, data, ns):
        earlier = data.draw(st.sampled_from(self.inserted))
        key = earlier[: data.draw(st.integers(self.page_size, len(earlier)))]
        node, prefix = self.match_and_check(key, ns)
        self.cache.inc_lock_ref(node)
        self.held.append((node, ns, prefix))
        for e in self.page_ends(0, len(prefix)):
            self.locks[(ns, prefix[:e])] = self.locks.get((ns, prefix[:e]), 0) + 1

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def unlock(self, data):
        node, ns, prefix = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.cache.dec_lock_ref(node)
        for e in self.page_ends(0, len(prefix)):
            self.locks[(ns, prefix[:e])] -= 1

    @precondition(lambda self: self.cache.total_size() > 0)
    @rule(num_tokens=st.integers(1, 16))
    def evict(self, num_tokens):
        self.evict_and_check(num_tokens)

    def evict_and_check(self, num_tokens: int) -> None:
        """Predicts the victims by scanning the tree with the model's access times and locks,
        then checks that ``evict`` removed exactly those."""
        nodes = {id(n): (n, ns, tokens, start) for n, ns, tokens, start in self.tree_nodes()}
        live_children = {key: len(entry[0].children) for key, entry in nodes.items()}
        victims, freed = [], 0
        while freed < num_tokens:
            leaves = [
                entry
                for key, entry in nodes.items()
                if live_children[key] == 0 and self.locks.get((entry[1], entry[2]), 0) == 0
            ]
            if not leaves:
                break
            victim = min(leaves, key=lambda e: self.touched[(e[1], e[2])])
            victims.append(victim)
            del nodes[id(victim[0])]
            freed += len(victim[0].key)
            if id(victim[0].parent) in live_children:
                live_children[id(victim[0].parent)] -= 1
        free_before = self.allocator.available_size()
        assert self.cache.evict(num_tokens) == freed
        assert self.allocator.available_size() == free_before + freed
        remaining = {id(n) for n, *_ in self.tree_nodes()}
        assert remaining == set(nodes)
        for _, ns, tokens, start in victims:
            for e in self.page_ends(start, len(tokens)):
                del self.slots[(ns, tokens[:e])]

    # -- invariants --

    @invariant()
    def sizes_add_up(self):
        cache = self.cache
        assert cache.evictable_size() + cache.protected_size() == cache.total_size()
        nodes = list(self.tree_nodes())
        assert cache.total_size() == sum(len(n.key) for n, *_ in nodes)
        assert cache.protected_size() == sum(len(n.key) for n, *_ in nodes if n.lock_ref > 0)

    @invariant()
    def tree_matches_model_and_structure(self):
        in_tree: dict[tuple, list[int]] = {}
        for node, ns, tokens, start in self.tree_nodes():
            assert len(node.key) == len(node.value) > 0
            assert len(node.key) % self.page_size == 0
            assert node.value.dtype == torch.int64
            for child_key, child in node.children.items():
                assert child.parent is node and child.extra_key == ns
                first = child.key[0] if self.page_size == 1 else tuple(child.key[: self.page_size])
                assert child_key == first
                assert node.last_access_time >= child.last_access_time
            assert node.lock_ref == self.locks.get((ns, tokens), 0)
            value = node.value.tolist()
            for e in self.page_ends(start, len(tokens)):
                in_tree[(ns, tokens[:e])] = value[e - start - self.page_size : e - start]
        assert in_tree == self.slots
        for node, ns, prefix in self.held:  # held nodes are still attached, at the same prefix
            assert node is self.cache.root or (path_tokens(node), node.extra_key) == (prefix, ns)

    @invariant()
    def every_slot_is_owned_once(self):
        p = self.page_size
        free_pages = self.allocator._free_pages
        assert len(set(free_pages)) == len(free_pages)
        tree_pages: list[int] = []
        for node, *_ in self.tree_nodes():
            for chunk in node.value.view(-1, p).tolist():
                page = chunk[0] // p
                assert chunk == list(range(page * p, page * p + p))  # one whole page
                tree_pages.append(page)
        assert len(set(tree_pages)) == len(tree_pages)
        assert not set(tree_pages) & set(free_pages)
        assert 0 not in tree_pages
        assert self.allocator.available_size() + self.cache.total_size() == self.allocator.size


class PagedRadixCacheMachine(RadixCacheMachine):
    page_size = 4
    num_pages = 16
    max_len = 18
    alphabet = 2  # so whole pages collide often


STATEFUL_SETTINGS = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRadixCacheStateful = RadixCacheMachine.TestCase
TestRadixCacheStateful.settings = STATEFUL_SETTINGS
TestPagedRadixCacheStateful = PagedRadixCacheMachine.TestCase
TestPagedRadixCacheStateful.settings = STATEFUL_SETTINGS
