"""The prefix-cache interface the scheduler programs against.

Two implementations: ``RadixCache`` (radix_tree.py), which shares KV across requests, and
``NoPrefixCache`` (no_cache.py), the baseline that shares nothing. This module owns the
types both speak (``MatchResult`` and the node handle ``CacheNode``), so neither
implementation imports the other.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch


class CacheNode:
    """An opaque handle on the end of a cached prefix, as returned by ``match_prefix``.

    A caller only hands it back to the cache that returned it (``inc_lock_ref`` /
    ``dec_lock_ref``) and may compare it by identity; each cache subclasses it with what it
    needs (``RadixCache``: a ``TreeNode``).
    """

    __slots__ = ()


@dataclass
class MatchResult:
    indices: torch.Tensor  # int64 KV slots of the longest cached prefix, one per matched token
    last_node: CacheNode  # where the match ends; the cache's root when nothing matched


class PrefixCache(ABC):
    """KV slots of token prefixes, kept across requests.

    Contract:
    - ``match_prefix(key, extra_key)`` returns the slots of the longest cached prefix of
      ``key`` in namespace ``extra_key`` (a multiple of ``page_size`` tokens) and the node
      where it ends. Until ``inc_lock_ref(node)`` the slots may be evicted.
    - A node locked with ``inc_lock_ref`` (and its ancestors) is never evicted until the
      matching ``dec_lock_ref``.
    - ``insert(key, indices, extra_key)`` offers a sequence's slots to the cache and returns
      how many leading tokens were already cached. The cache never frees on insert: when
      ``keeps_inserted`` the caller frees its own duplicates and the unaligned tail; when
      not, the caller frees all of ``indices``.
    - ``evict(n)`` frees at least ``n`` tokens' slots through the allocator, least recently
      used first, or everything evictable; it is the only call that frees.
    - ``evictable_size() + protected_size() == total_size()``: tokens held unlocked, locked,
      and in all.
    - ``reset()`` forgets everything without freeing: the caller resets the allocator.
    """

    keeps_inserted: bool
    page_size: int
    matches_stay_valid: bool = True
    """Whether a match stays lockable until the tree is next changed by an insert or an
    eviction the caller makes; False: ``load_back`` may evict (match again after it)."""

    @abstractmethod
    def match_prefix(self, key: Sequence[int], extra_key: str | None = None) -> MatchResult: ...

    @abstractmethod
    def insert(
        self, key: Sequence[int], indices: torch.Tensor, extra_key: str | None = None
    ) -> int: ...

    @abstractmethod
    def inc_lock_ref(self, node: CacheNode) -> None: ...

    @abstractmethod
    def dec_lock_ref(self, node: CacheNode) -> None: ...

    @abstractmethod
    def evict(self, num_tokens: int) -> int: ...

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    def total_size(self) -> int:
        return self.evictable_size() + self.protected_size()

    def continuation(self, key: Sequence[int], max_tokens: int,
                     extra_key: str | None = None) -> list[int]:
        """Up to ``max_tokens`` tokens cached right after the whole of ``key`` (a draft
        for speculative decoding), down the most recently used branch where cached
        sequences fork; [] where no cached sequence extends ``key``, and for an empty
        ``key``. Changes nothing: no split, no access time."""
        found = self.continuations(key, max_tokens, 1, extra_key)
        return found[0] if found else []

    def continuations(self, key: Sequence[int], max_tokens: int, max_branches: int,
                      extra_key: str | None = None) -> list[list[int]]:
        """Up to ``max_branches`` distinct continuations of ``key`` as ``continuation``
        finds one, most recently used first (a draft's token tree). A cache that keeps
        nothing finds nothing."""
        return []

    def load_back(self, key: Sequence[int], extra_key: str | None = None) -> int:
        """Brings into the cache, from lower tiers, KV that continues the cached prefix of
        ``key``; returns how many tokens the prefix grew by. A cache of one tier: 0."""
        return 0

    def prefetch(self, key: Sequence[int], extra_key: str | None = None) -> Future | None:
        """Starts bringing KV of ``key`` from the slowest tier nearer (``load_back`` then
        finds it); a future that is done when it is, or None: nothing to wait for."""
        return None

    @abstractmethod
    def reset(self) -> None: ...

    @abstractmethod
    def pretty_print(self) -> str: ...
