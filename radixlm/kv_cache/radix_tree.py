"""The radix-tree prefix cache: KV slots of token prefixes shared across requests.

Edges are token-id sequences; each node holds the KV slot indices of its edge's tokens, so
the slots of a prefix are the concatenation of the values along its path (RadixAttention,
Zheng et al., "SGLang: Efficient Execution of Structured Language Model Programs", 2024).

Ownership: a slot index is held by exactly one party, a request or the tree. ``insert``
never frees: it returns how many leading tokens ``n`` were already cached, and the caller
frees the slots it holds for them itself (see ``RadixCache.insert``) and, with
``page_size > 1``, the unaligned tail. ``evict`` is the only call that frees, through the
allocator. ``reset`` drops everything without freeing: the caller resets the allocator.

Invariants:
- every non-root edge is non-empty, ``len(node.key) == len(node.value)``, and with
  ``page_size > 1`` its length is a multiple of ``page_size`` (so edges hold whole pages);
- siblings differ in their first token (first page when ``page_size > 1``); children of
  the root are keyed by ``(extra_key, first token or page)``, so namespaces share no node;
- ``node.lock_ref`` counts the locks held on the node or any descendant; a locked node's
  tokens count in ``protected_size``, an unlocked node's in ``evictable_size``;
- ``parent.last_access_time >= child.last_access_time`` (every touch covers the whole path);
- the eviction queue holds exactly the unlocked non-root leaves, ordered by
  ``(last_access_time, node_id)``; it is updated on every change, never rebuilt.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch
from sortedcontainers import SortedKeyList

from radixlm.kv_cache.allocator import TokenToKVPoolAllocator
from radixlm.kv_cache.base import CacheNode, MatchResult, PrefixCache


class TreeNode(CacheNode):
    """One edge of the tree: the tokens ``key`` and their KV slots ``value``."""

    __slots__ = (
        "node_id",
        "key",
        "value",
        "extra_key",
        "parent",
        "children",
        "lock_ref",
        "last_access_time",
    )

    def __init__(
        self,
        node_id: int,
        key: tuple[int, ...],
        value: torch.Tensor,
        extra_key: str | None,
        parent: TreeNode | None,
        access_time: int,
    ):
        self.node_id = node_id
        self.key = key
        self.value = value
        self.extra_key = extra_key
        self.parent = parent
        self.children: dict[Hashable, TreeNode] = {}
        self.lock_ref = 0
        self.last_access_time = access_time

    def __repr__(self) -> str:
        return f"TreeNode(id={self.node_id}, len={len(self.key)}, lock_ref={self.lock_ref})"


class RadixCache(PrefixCache):
    """A prefix cache of KV slots indexed by a radix tree over token ids.

    ``match_prefix`` returns a ``MatchResult`` whose ``last_node`` is a ``TreeNode``: the
    deepest node of the match, the root when nothing matched.

    Request life cycle: ``match_prefix`` then ``inc_lock_ref(last_node)`` so the prefix
    cannot be evicted while the request runs (its slot row starts with ``indices``, which
    stay the tree's); when it finishes, ``insert`` its tokens, free its duplicates, and
    ``dec_lock_ref`` the node it locked. A chunked prefill that caches its first chunk does
    ``insert``, then a fresh ``match_prefix``, locks the new ``last_node`` and unlocks the old.
    """

    keeps_inserted = True  # insert keeps indices[returned:aligned_len]; see NoPrefixCache

    def __init__(self, allocator: TokenToKVPoolAllocator, page_size: int = 1):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if getattr(allocator, "page_size", page_size) != page_size:
            raise ValueError(
                f"page_size={page_size} differs from the allocator's {allocator.page_size}"
            )
        self.allocator = allocator
        self.page_size = page_size
        self.on_evict: Callable[[TreeNode], None] | None = None
        """Called with each leaf ``evict`` is about to free, while its path is still in
        the tree (``prefix_of``): a lower tier keeps its KV (``hierarchical_cache.py``)."""
        self.reset()

    def reset(self) -> None:
        """Empties the tree WITHOUT freeing its slots; the caller resets the allocator too."""
        self._clock = 0
        self._next_id = 0
        self.root = self._new_node((), self._empty(), None, None)
        self._evictable_tokens = 0
        self._protected_tokens = 0
        self._evict_queue: SortedKeyList = SortedKeyList(
            key=lambda n: (n.last_access_time, n.node_id)
        )

    # ---- queries --------------------------------------------------------------------

    def match_prefix(self, key: Sequence[int], extra_key: str | None = None) -> MatchResult:
        """The cached slots of the longest prefix of ``key`` (page-aligned).

        A match ending inside an edge splits that edge, so ``last_node`` ends exactly at the
        match. The access times along the path are refreshed.
        """
        key = self._aligned(key)
        node, pos, path = self.root, 0, []
        while pos < len(key):
            child = node.children.get(self._child_key(node, key, pos, extra_key))
            if child is None:
                break
            n = self._common_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            path.append(child)
            node, pos = child, pos + n
        self._touch(node)
        values = [child.value for child in path]
        indices = torch.cat(values) if values else self._empty()
        return MatchResult(indices=indices, last_node=node)

    def cached_length(self, key: Sequence[int], extra_key: str | None = None) -> int:
        """How many leading tokens of ``key`` ``match_prefix`` would find (page-aligned),
        changing nothing: no split, no access time."""
        key = self._aligned(key)
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(self._child_key(node, key, pos, extra_key))
            if child is None:
                break
            n = self._common_len(child.key, key, pos)
            pos += n
            if n < len(child.key):
                break
            node = child
        return pos

    def continuations(self, key: Sequence[int], max_tokens: int, max_branches: int,
                      extra_key: str | None = None) -> list[list[int]]:
        """Up to ``max_branches`` distinct continuations of the whole (unaligned) ``key``,
        each up to ``max_tokens`` tokens, most recently used first: where the tree forks
        below ``key``, each branch (in order of last use) gives one (a draft's token tree).
        [] where nothing follows ``key`` (``PrefixCache.continuations``)."""
        key = self._key_tuple(key)
        if not key or max_tokens <= 0:  # no context: nothing follows it in particular
            return []
        node, pos = self.root, 0
        while pos < len(key):
            if len(key) - pos < self.page_size:  # it ends inside a page: every child
                return self._branches_after_head(node, key[pos:], max_tokens, max_branches,
                                                 extra_key)
            child = node.children.get(self._child_key(node, key, pos, extra_key))
            if child is None:
                return []
            edge, remaining = child.key, len(key) - pos
            if remaining <= len(edge):
                if key[pos:] != edge[:remaining]:
                    return []
                found = list(edge[remaining : remaining + max_tokens])
                return self._branches(child, found, max_tokens, max_branches)
            if key[pos : pos + len(edge)] != edge:
                return []
            node, pos = child, pos + len(edge)
        return self._branches(node, [], max_tokens, max_branches)

    def _branches_after_head(self, node: TreeNode, head: tuple[int, ...], max_tokens: int,
                             max_branches: int, extra_key: str | None) -> list[list[int]]:
        """The branches of the children of ``node`` whose edges begin with ``head`` (less
        than a page), latest-used child first."""
        found = [child for child in node.children.values()
                 if child.key[: len(head)] == head
                 and (node is not self.root or child.extra_key == extra_key)]
        branches: list[list[int]] = []
        for child in sorted(found, key=lambda child: child.last_access_time, reverse=True):
            rest = list(child.key[len(head) : len(head) + max_tokens])
            branches += self._branches(child, rest, max_tokens, max_branches - len(branches))
            if len(branches) >= max_branches:
                break
        return branches

    @staticmethod
    def _branches(node: TreeNode, found: list[int], max_tokens: int,
                  max_branches: int) -> list[list[int]]:
        """``found`` lengthened by the edges below ``node``, one list per branch (depth
        first, latest-used child first), at most ``max_branches``; none empty."""
        branches: list[list[int]] = []
        stack = [(node, found)]
        while stack and len(branches) < max_branches:
            node, found = stack.pop()
            if len(found) >= max_tokens or not node.children:
                if found:
                    branches.append(found)
                continue
            for child in sorted(node.children.values(), key=lambda c: c.last_access_time):
                stack.append((child, found + list(child.key[: max_tokens - len(found)])))
        return branches

    def insert(
        self, key: Sequence[int], indices: torch.Tensor, extra_key: str | None = None
    ) -> int:
        """Caches ``key`` with its slots ``indices``; returns how many leading tokens were
        already cached.

        Only the page-aligned part of ``key`` is inserted. The tree keeps a copy of
        ``indices[n:aligned_len]`` (``n`` the return value) and never frees. The caller
        frees ``indices[aligned_len:]`` and the duplicates among ``indices[:n]``: the slots
        it allocated itself, i.e. ``indices[m:n]`` when ``indices[:m]`` came from its own
        (locked) ``match_prefix``, or all of ``indices[:n]`` when every slot was fresh.
        """
        key = self._key_tuple(key)
        if len(key) != len(indices):
            raise ValueError(f"key has {len(key)} tokens but indices has {len(indices)}")
        key = self._aligned(key)
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(self._child_key(node, key, pos, extra_key))
            if child is None:
                break
            n = self._common_len(child.key, key, pos)
            if n < len(child.key):
                # Split even when the key ends here, so the touch below covers exactly it.
                child = self._split(child, n)
            node, pos = child, pos + n
        cached = pos
        if pos < len(key):
            if node.lock_ref == 0 and not node.children and node is not self.root:
                self._evict_queue.remove(node)
            value = indices[pos : len(key)].to(dtype=torch.int64, copy=True)
            leaf = self._new_node(key[pos:], value, extra_key, node)
            node.children[self._child_key(node, key, pos, extra_key)] = leaf
            self._evictable_tokens += len(leaf.key)
            self._evict_queue.add(leaf)
            node = leaf
        self._touch(node)
        return cached

    # ---- locks ----------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Locks ``node`` and its ancestors (root excluded) against eviction."""
        if node is not self.root and node.parent is None:
            raise ValueError(f"{node} was evicted; lock the node returned by a fresh match")
        while node.parent is not None:  # stops at the root
            if node.lock_ref == 0:
                if not node.children:
                    self._evict_queue.remove(node)
                self._evictable_tokens -= len(node.key)
                self._protected_tokens += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Releases one lock taken by ``inc_lock_ref(node)``."""
        if node.parent is not None and node.lock_ref <= 0:
            raise ValueError(f"{node} is not locked")
        while node.parent is not None:  # ancestors hold at least node's locks
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected_tokens -= len(node.key)
                self._evictable_tokens += len(node.key)
                if not node.children:
                    self._evict_queue.add(node)
            node = node.parent

    # ---- eviction -------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Frees least-recently-used unlocked leaves until ``num_tokens`` tokens are freed or
        nothing is evictable; returns the number of tokens freed."""
        freed = 0
        while freed < num_tokens and self._evict_queue:
            leaf = self._evict_queue.pop(0)
            if self.on_evict is not None:
                self.on_evict(leaf)
            parent = leaf.parent
            del parent.children[self._child_key(parent, leaf.key, 0, leaf.extra_key)]
            self.allocator.free(leaf.value)
            freed += len(leaf.key)
            self._evictable_tokens -= len(leaf.key)
            leaf.parent = None  # marks it detached, so a stale lock on it is caught
            if parent is not self.root and parent.lock_ref == 0 and not parent.children:
                self._evict_queue.add(parent)
        return freed

    def prefix_of(self, node: TreeNode) -> tuple[tuple[int, ...], torch.Tensor]:
        """The tokens from the root down to the end of ``node`` and their slots."""
        keys, values = [], []
        while node.parent is not None:
            keys.append(node.key)
            values.append(node.value)
            node = node.parent
        tokens = tuple(token for key in reversed(keys) for token in key)
        return tokens, torch.cat(values[::-1]) if values else self._empty()

    def evictable_size(self) -> int:
        return self._evictable_tokens

    def protected_size(self) -> int:
        return self._protected_tokens

    def pretty_print(self) -> str:
        """The tree, one node per line, indented by depth."""
        lines = [f"root (evictable={self.evictable_size()}, protected={self.protected_size()})"]
        stack = [(child, 1) for child in reversed(self.root.children.values())]
        while stack:
            node, depth = stack.pop()
            shown = list(node.key[:16])
            more = f" ... +{len(node.key) - 16}" if len(node.key) > 16 else ""
            ns = f" ns={node.extra_key!r}" if depth == 1 else ""
            lines.append(
                f"{'  ' * depth}{shown}{more} len={len(node.key)}{ns} "
                f"lock={node.lock_ref} t={node.last_access_time}"
            )
            stack.extend((child, depth + 1) for child in reversed(node.children.values()))
        return "\n".join(lines)

    # ---- internals ------------------------------------------------------------------

    def _new_node(
        self,
        key: tuple[int, ...],
        value: torch.Tensor,
        extra_key: str | None,
        parent: TreeNode | None,
    ) -> TreeNode:
        self._next_id += 1
        return TreeNode(self._next_id, key, value, extra_key, parent, self._clock)

    def _split(self, node: TreeNode, n: int) -> TreeNode:
        """Cuts ``node``'s edge after ``n`` tokens; returns the new upper node.

        ``node`` keeps its identity as the lower part, so a caller holding (and locking) it
        still denotes the same prefix. Sizes and the eviction queue are unchanged.
        """
        parent = node.parent
        slot = self._child_key(parent, node.key, 0, node.extra_key)
        upper = self._new_node(node.key[:n], node.value[:n], node.extra_key, parent)
        upper.lock_ref = node.lock_ref
        upper.last_access_time = node.last_access_time
        node.key, node.value, node.parent = node.key[n:], node.value[n:], upper
        upper.children[self._child_key(upper, node.key, 0, node.extra_key)] = node
        parent.children[slot] = upper
        return upper

    def _touch(self, node: TreeNode) -> None:
        """Stamps ``node`` and its ancestors with a new access time."""
        self._clock += 1
        if node.lock_ref == 0 and not node.children and node is not self.root:
            # The queue is sorted by access time: re-key the leaf by removing and re-adding.
            self._evict_queue.remove(node)
            node.last_access_time = self._clock
            self._evict_queue.add(node)
            node = node.parent
        while node is not None:
            node.last_access_time = self._clock
            node = node.parent

    def _child_key(
        self, parent: TreeNode, key: Sequence[int], pos: int, extra_key: str | None
    ) -> Hashable:
        first = key[pos] if self.page_size == 1 else tuple(key[pos : pos + self.page_size])
        return (extra_key, first) if parent is self.root else first

    def _common_len(self, edge: tuple[int, ...], key: tuple[int, ...], pos: int) -> int:
        """Length of the common prefix of ``edge`` and ``key[pos:]``, in whole pages."""
        n = min(len(edge), len(key) - pos)
        if key[pos : pos + n] == edge[:n]:
            return n
        i, step = 0, self.page_size
        if step == 1:
            while edge[i] == key[pos + i]:  # stops before n: the full slices differ
                i += 1
            return i
        while key[pos + i : pos + i + step] == edge[i : i + step]:
            i += step
        return i

    def _aligned(self, key: Sequence[int]) -> tuple[int, ...]:
        key = self._key_tuple(key)
        return key[: len(key) - len(key) % self.page_size]

    @staticmethod
    def _key_tuple(key: Sequence[int]) -> tuple[int, ...]:
        if isinstance(key, torch.Tensor):
            return tuple(key.tolist())
        return key if isinstance(key, tuple) else tuple(key)

    def _empty(self) -> torch.Tensor:
        device = getattr(self.allocator, "device", "cpu")
        return torch.empty(0, dtype=torch.int64, device=device)
