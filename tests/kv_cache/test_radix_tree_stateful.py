"""A hypothesis state machine for radixlm/kv_cache/radix_tree.py.

It drives the cache with the real allocator through random inserts, matches, locks, unlocks
and evictions, against a reference model: a dict from every cached (namespace, page-aligned
prefix) to the KV slots of its last page, with access times and lock counts kept per prefix,
independent of the tree's own bookkeeping. The invariants are checked after every step.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixlm.kv_cache.allocator import TokenToKVPoolAllocator
from radixlm.kv_cache.radix_tree import RadixCache, TreeNode


def path_tokens(node: TreeNode) -> tuple[int, ...]:
    parts = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return tuple(t for part in reversed(parts) for t in part)


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
