"""The radix cache over a hybrid pool (``hybrid_pool.py``): a cached prefix is usable only
where its sliding layers' KV of the window before its end is still held.

A sliding layer with window W computing the token at position P reads the keys of
positions P - W + 1 .. P - 1, so a cached prefix of length P is usable by a request only if
the local KV of its last W - 1 tokens is held. Tokens enter the tree whether or not their
local KV still is (a request frees the local KV of what falls out of its window as it
runs; their full KV is still what the full-attention layers read), so:

- ``match_prefix`` cuts the longest match back to the longest page-aligned length P whose
  window ``[P - W + 1, P)`` is held (splitting the edge there); ``match_inserted`` does not
  cut (a running request's own tokens, whose window it holds itself);
- ``insert`` adopts the inserting request's local KV for tokens the tree held without it
  (same tokens, same KV: the local page moves to the tree's page, ``move_local``);
- local KV is evicted apart from full KV (``evict_local``), least recently used first,
  when the local pool is short: a node keeps its full KV and its place in the tree.

Window locks: a running request that still reads the local KV of the last tokens of its
locked prefix holds a window lock on the prefix's last node (``lock_window``, counted in
``window_locks``; a node keeps its identity when an edge is split above it). The W - 1
tokens before a window-locked node's end (the pages they lie in) are never evicted
locally. Every window-locked node is also locked (``inc_lock_ref``), so it is never evicted.

The radix tree's own invariants (``radix_tree.py``) hold unchanged; eviction of full KV
frees the local KV with it (``HybridAllocator.free``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixlm.kv_cache.base import MatchResult
from radixlm.kv_cache.hybrid_pool import HybridAllocator
from radixlm.kv_cache.radix_tree import RadixCache, TreeNode


class WindowedRadixCache(RadixCache):
    """A ``RadixCache`` whose matches keep the window of a sliding layer complete."""

    def __init__(self, allocator: HybridAllocator, page_size: int, window: int):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self.window_locks: dict[TreeNode, int] = {}
        super().__init__(allocator, page_size)

    def reset(self) -> None:
        super().reset()
        self.window_locks = {}

    # ---- matches --------------------------------------------------------------------

    def match_prefix(self, key: Sequence[int], extra_key: str | None = None) -> MatchResult:
        """The longest cached prefix of ``key`` whose window is held (module docstring)."""
        match = super().match_prefix(key, extra_key)
        usable = self.usable_length(match.indices)
        if usable == len(match.indices):
            return match
        return MatchResult(indices=match.indices[:usable],
                           last_node=self._node_ending_at(match.last_node, usable))

    def match_inserted(self, key: Sequence[int], extra_key: str | None = None) -> MatchResult:
        """The whole cached prefix of ``key``, its window held or not: for a request that
        just inserted ``key`` and holds its own window."""
        return super().match_prefix(key, extra_key)

    def usable_length(self, indices: torch.Tensor) -> int:
        """The longest page-aligned P <= len(indices) whose tokens ``[P - W + 1, P)`` all
        have their local KV held (0 always qualifies)."""
        n = len(indices)
        if n == 0:
            return 0
        dropped = ~self.allocator.local_held(indices)
        if not bool(dropped.any()):
            return n
        before = torch.zeros(n + 1, dtype=torch.int64)  # before[i]: dropped in [0, i)
        before[1:] = torch.cumsum(dropped.to(torch.int64), 0)
        ends = torch.arange(0, n + 1, self.page_size)
        starts = (ends - self.window + 1).clamp(min=0)
        complete = (before[ends] - before[starts]) == 0
        return int(ends[complete].max())

    def _node_ending_at(self, node: TreeNode, length: int) -> TreeNode:
        """The node whose edge ends ``length`` tokens into the path that ends at ``node``
        (splitting an edge there); the root for 0."""
        if length == 0:
            return self.root
        path = []
        while node is not self.root:
            path.append(node)
            node = node.parent
        end = 0
        for node in reversed(path):
            start, end = end, end + len(node.key)
            if end == length:
                return node
            if end > length:
                return self._split(node, length - start)
        return self.root

    # ---- insertion ------------------------------------------------------------------

    def insert(
        self, key: Sequence[int], indices: torch.Tensor, extra_key: str | None = None
    ) -> int:
        """``RadixCache.insert``; the tree's copies of the tokens already cached take the
        inserter's local KV where they had lost theirs."""
        cached = super().insert(key, indices, extra_key)
        if cached:
            tree_slots = super().match_prefix(self._key_tuple(key)[:cached], extra_key).indices
            self.allocator.move_local(indices[:cached], tree_slots)
        return cached

    # ---- window locks ---------------------------------------------------------------

    def lock_window(self, node: TreeNode) -> None:
        """Keeps the local KV of the W - 1 tokens before ``node``'s end (``node`` locked)."""
        if node is self.root:
            return
        if node.lock_ref <= 0:
            raise ValueError(f"{node} is not locked: lock it before its window")
        self.window_locks[node] = self.window_locks.get(node, 0) + 1

    def unlock_window(self, node: TreeNode) -> None:
        if node is self.root:
            return
        count = self.window_locks.get(node, 0)
        if count <= 0:
            raise ValueError(f"{node} has no window lock")
        if count == 1:
            del self.window_locks[node]
        else:
            self.window_locks[node] = count - 1

    # ---- local eviction -------------------------------------------------------------

    def evict_local(self, num_tokens: int) -> int:
        """Frees the local KV of least-recently-used nodes, outside every window lock's
        W - 1 tokens, until ``num_tokens`` local slots are freed or none is left; returns
        the number freed. Walks the whole tree: it runs only when the local pool is short."""
        freed = 0
        for node, evictable in self._local_evictable():
            if freed >= num_tokens:
                break
            freed += self.allocator.release_local(node.value[:evictable])
        return freed

    def local_evictable_size(self) -> int:
        """Local slots the tree holds outside every window lock's W - 1 tokens."""
        return sum(int(self.allocator.local_held(node.value[:evictable]).sum())
                   for node, evictable in self._local_evictable())

    def _local_evictable(self) -> list[tuple[TreeNode, int]]:
        """(node, how many of its leading tokens may lose their local KV: whole pages
        before the part a window lock keeps), least recently used first."""
        kept = self._window_kept()
        found = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            evictable = len(node.key) - kept.get(node, 0)
            evictable -= evictable % self.page_size
            if evictable > 0 and bool(self.allocator.local_held(node.value[:evictable]).any()):
                found.append((node, evictable))
        found.sort(key=lambda item: (item[0].last_access_time, item[0].node_id))
        return found

    def _window_kept(self) -> dict[TreeNode, int]:
        """Node -> how many of its last tokens lie among the W - 1 tokens before a
        window-locked node's end."""
        kept: dict[TreeNode, int] = {}
        for node in self.window_locks:
            left = self.window - 1
            while node is not self.root and left > 0:
                here = min(left, len(node.key))
                kept[node] = max(kept.get(node, 0), here)
                left -= here
                node = node.parent
        return kept
