"""The hierarchical prefix cache against a reference model: a hypothesis state machine
over insert, match, lock, evict, load and prefetch across the tiers (with and without
pages and a disk tier).

Every test runs over ``tests/hierarchical_rig.py``'s ``Rig``: real allocator, pool and
tiers, each request writing the KV a model would (``kv_of``, a hash of its prefix), so a
match or a load is checked against what a fresh computation would have written; every test
ends with the accounting balanced (``free + cached + held == pool``) and nothing protected
once no lock is held (the machine's ``teardown``).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch
from hierarchical_rig import (
    Rig,
    assert_kv,
    kv_of,
    read_kv,
)
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixlm.kv_cache.allocator import pages_for

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
