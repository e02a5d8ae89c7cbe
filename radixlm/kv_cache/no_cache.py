"""The prefix cache that caches nothing: the baseline when ``disable_radix_cache=True``.

It serves ``RadixCache``'s interface so the scheduler has one code path, but every request
computes its whole prompt. Nothing is ever owned by this cache, so it never frees either.

Caller contract differs from ``RadixCache`` in one place: ``insert`` keeps nothing and
returns 0, so the CALLER frees ALL of ``indices`` (with ``RadixCache`` it frees only
``indices[:returned]`` and the unaligned tail). ``keeps_inserted`` says which applies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixlm.kv_cache.allocator import TokenToKVPoolAllocator
from radixlm.kv_cache.base import CacheNode, MatchResult, PrefixCache


class NoPrefixCache(PrefixCache):
    """Matches nothing, stores nothing, evicts nothing; every size is 0."""

    keeps_inserted = False

    def __init__(self, allocator: TokenToKVPoolAllocator, page_size: int = 1):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        device = getattr(allocator, "device", "cpu")
        self.root = CacheNode()  # every match ends here: the empty prefix
        self._no_slots = torch.empty(0, dtype=torch.int64, device=device)

    def match_prefix(self, key: Sequence[int], extra_key: str | None = None) -> MatchResult:
        return MatchResult(indices=self._no_slots, last_node=self.root)

    def insert(
        self, key: Sequence[int], indices: torch.Tensor, extra_key: str | None = None
    ) -> int:
        """Keeps nothing and returns 0: the caller frees all of ``indices``."""
        if len(key) != len(indices):
            raise ValueError(f"key has {len(key)} tokens but indices has {len(indices)}")
        return 0

    def inc_lock_ref(self, node: CacheNode) -> None:
        pass

    def dec_lock_ref(self, node: CacheNode) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def reset(self) -> None:
        pass

    def pretty_print(self) -> str:
        return "root (prefix caching disabled)"
