"""The KV memory a request holds, and how it passes to and from the prefix cache.

A request's KV slots live in its row of ``req_to_token``. The first ``len(req.prefix_indices)``
of them belong to the tree (matched at admission, locked while the request runs); the rest
were allocated for the request and are its own until it hands them to the tree.

The slots live on the device; the host keeps what it needs to allocate and free without
reading them back: each request's last slot (``req.last_slot``, from the allocator's host
page numbers), and the rule that a cached prefix is whole pages (``PrefixCache``), so a
finished request's unaligned tail is the one page of its last slot. What is still read
back (its own duplicates of tokens cached meanwhile, eviction, a request freed without the
cache) is declared in ``host_reads.py``.
"""

from __future__ import annotations

import torch

from radixlm.host_to_device import to_device
from radixlm.kv_cache.allocator import (
    OutOfKVSlots,
    TokenToKVPoolAllocator,
    opens_page,
    pages_for,
)
from radixlm.kv_cache.base import MatchResult, PrefixCache
from radixlm.kv_cache.memory_pool import ReqToTokenPool
from radixlm.runtime.request import Req


class RequestMemory:
    """Request rows, KV slots and the prefix cache, operated on per request.

    Invariant (checked by tests after every run):
    ``allocator.available_size() + tree.total_size() + slots held by running requests
    (beyond their tree prefix) == allocator.size``.
    """

    window: int | None = None
    """W of the model's sliding layers where they keep only their window's KV
    (``windowed_memory.WindowedRequestMemory``); None: every layer keeps every token's."""

    def __init__(
        self, req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator,
        tree_cache: PrefixCache,
    ):
        self.req_to_token_pool = req_to_token_pool
        self.req_to_token = req_to_token_pool.req_to_token
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.page_size = allocator.page_size

    def available_tokens(self) -> int:
        """KV slots that can be had now: free ones plus what the cache could evict."""
        return self.allocator.available_size() + self.tree_cache.evictable_size()

    def match_and_lock(self, req: Req, match: MatchResult | None = None) -> None:
        """Locks the request's cached prefix: ``match``, a match of ``req.match_key()`` made
        since the tree last changed, or else one made here (after a hierarchical cache
        loaded what its lower tiers hold of the prompt: ``PrefixCache.load_back``)."""
        loaded = self.tree_cache.load_back(req.match_key(), req.extra_key)
        if match is None or loaded or not self.tree_cache.matches_stay_valid:
            match = self.tree_cache.match_prefix(req.match_key(), req.extra_key)
        req.prefix_indices = match.indices
        req.last_node = match.last_node
        self.tree_cache.inc_lock_ref(match.last_node)

    def unlock(self, req: Req) -> None:
        """Undoes ``match_and_lock`` for a request that was not admitted after all."""
        self.tree_cache.dec_lock_ref(req.last_node)
        req.prefix_indices, req.last_node = None, None

    def assign_row(self, req: Req) -> None:
        """Gives the request a row holding its cached prefix (counted in ``cached_tokens``
        the first time only: a retracted request's recomputation is no cache hit)."""
        row = self.req_to_token_pool.alloc()
        assert row is not None, "admission checks for a free row first"
        prefix = req.prefix_indices
        self.req_to_token[row, : len(prefix)] = prefix
        req.req_pool_idx, req.kv_len = row, len(prefix)
        if not req.retractions:
            req.cached_tokens = len(prefix)
        # The prefix is whole pages: the next token opens a fresh page, so the last slot of
        # any page stands for the prefix's (no device read); no prefix: none yet.
        req.last_slot = self.page_size - 1 if len(prefix) else -1

    def alloc(self, req: Req, num_tokens: int, listed: list[int] | None = None
              ) -> torch.Tensor:
        """Slots for the request's next ``num_tokens`` tokens, evicting from the cache if
        needed. ``listed``: extended by them as host integers too (a speculative verify
        step, which gives back those of rejected draft tokens: ``give_back``)."""
        self._make_room(pages_for(num_tokens, self.page_size))
        try:
            if listed is None:
                slots, last_slot = self.allocator.extend(req.last_slot, num_tokens)
            else:
                found = self.allocator.extend_listed(req.last_slot, num_tokens)
                listed += found
                slots = to_device(found, torch.int64, self.req_to_token.device)
                last_slot = found[-1] if found else req.last_slot
        except OutOfKVSlots as err:
            raise OutOfKVSlots(f"{err}; the scheduler's reservation was wrong") from err
        self.req_to_token[req.req_pool_idx, req.kv_len : req.kv_len + num_tokens] = slots
        req.last_slot = last_slot  # the caller advances req.kv_len
        return slots

    def give_back(self, req: Req, listed: list[int], keep: int) -> None:
        """Frees all but the first ``keep`` (>= 1) of ``listed``, the request's latest
        ``alloc`` slots, listed (whose tokens it has in ``kv_len``): their KV is of tokens it
        did not keep. ``kv_len`` goes back by as many."""
        if not 1 <= keep <= len(listed):
            raise ValueError(f"give_back keeps 1..{len(listed)} slots, got {keep}")
        self.allocator.free_tail(listed, keep)
        req.kv_len -= len(listed) - keep
        req.last_slot = listed[keep - 1]

    def alloc_pages(self, num_tokens: int) -> torch.Tensor:
        """Slots for ``num_tokens`` tokens in fresh pages (no request's row), evicting from
        the cache if needed."""
        self._make_room(pages_for(num_tokens, self.page_size))
        return self.allocator.alloc(num_tokens)

    def alloc_decode(self, reqs: list[Req], rows: torch.Tensor,
                     columns: torch.Tensor) -> torch.Tensor:
        """One slot for each request's next token, in one allocation: the next slot of
        the request's last page where it has room, else a fresh page.

        ``rows`` and ``columns`` (B,) on the pool's device: the requests' rows and
        ``kv_len``s, where the slots are written."""
        if self.page_size > 1:
            last_slots = [req.last_slot for req in reqs]
            fresh = sum(opens_page(last, self.page_size) for last in last_slots)
            self._make_room(fresh * self.page_size)
            try:
                next_slots = self.allocator.alloc_next(last_slots)
            except OutOfKVSlots as err:
                raise OutOfKVSlots(f"{err}; the scheduler's reservation was wrong") from err
            for req, slot in zip(reqs, next_slots):
                req.last_slot = slot
            slots = to_device(next_slots, torch.int64, self.req_to_token.device)
        else:
            self._make_room(len(reqs))
            slots = self.allocator.alloc(len(reqs))  # pages of one token keep no last_slot
        self.req_to_token[rows, columns] = slots
        return slots

    def _make_room(self, slots: int) -> None:
        """Evicts from the cache until ``slots`` slots are free (as far as it can)."""
        shortfall = slots - self.allocator.available_size()
        if shortfall > 0:
            self.tree_cache.evict(shortfall)

    def cache_unfinished(self, req: Req) -> None:
        """Shares what the running request has computed so far, and keeps running on it.

        Its KV enters the tree; slots that duplicate ones cached meanwhile are freed and
        replaced in its row by the cached ones; the lock moves to the new deepest node.
        """
        if not self.tree_cache.keeps_inserted:
            return
        kv_len = req.kv_len
        aligned = kv_len - kv_len % self.page_size
        if aligned <= len(req.prefix_indices):
            return
        tokens = req.all_ids()[:aligned]
        slots = self.req_to_token[req.req_pool_idx, :aligned]
        already = self.tree_cache.insert(tokens, slots, req.extra_key)
        self._free_duplicates(req, slots, already)
        match = self._match_inserted(tokens, req.extra_key)
        self.req_to_token[req.req_pool_idx, : len(match.indices)] = match.indices
        self.req_to_token_pool.mark_rewritten(req.req_pool_idx, len(match.indices))
        self.tree_cache.dec_lock_ref(req.last_node)
        self.tree_cache.inc_lock_ref(match.last_node)
        req.prefix_indices, req.last_node = match.indices, match.last_node

    def _match_inserted(self, tokens: list[int], extra_key: str | None) -> MatchResult:
        """The cache's slots of tokens the request just inserted."""
        return self.tree_cache.match_prefix(tokens, extra_key)

    def release(self, req: Req) -> None:
        """Hands a finished (or aborted) request's KV to the cache and frees the rest."""
        slots = self.req_to_token[req.req_pool_idx, : req.kv_len].clone()
        if self.tree_cache.keeps_inserted:
            aligned = req.kv_len - req.kv_len % self.page_size
            tokens = req.all_ids()[:aligned]
            already = self.tree_cache.insert(tokens, slots[:aligned], req.extra_key)
            self._free_duplicates(req, slots, already)
            if req.kv_len > aligned:  # (a prefix is whole pages: this one is its own)
                # The unaligned tail: one page, the one of its last slot.
                page = req.last_slot // self.page_size
                if not 0 < page <= self.allocator.num_pages:  # page 0 is the padding page
                    raise RuntimeError(f"request {req.rid}: its last slot {req.last_slot} "
                                       f"is on no page of the pool")
                self.allocator.free_pages([page])
        else:
            self._free_uncached(req, slots)
        self.tree_cache.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx, req.kv_len, req.last_slot = None, 0, -1
        req.prefix_indices, req.last_node = None, None

    def discard(self, req: Req) -> None:
        """Frees what the request holds without caching any of it (its KV is not known to
        be computed: a disaggregated request whose KV never arrived)."""
        slots = self.req_to_token[req.req_pool_idx, len(req.prefix_indices) : req.kv_len]
        self.allocator.free(slots.clone())
        self.tree_cache.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx, req.kv_len, req.last_slot = None, 0, -1
        req.prefix_indices, req.last_node = None, None

    def _free_uncached(self, req: Req, slots: torch.Tensor) -> None:
        """Frees a finished request's own slots where the cache keeps nothing (read back
        from the device: the host keeps only the request's last slot)."""
        self.allocator.free(slots[len(req.prefix_indices):])

    def _free_duplicates(self, req: Req, slots: torch.Tensor, already_cached: int) -> None:
        """Frees the request's own slots for tokens another request cached first."""
        start = len(req.prefix_indices)
        if already_cached > start:
            self.allocator.free(slots[start:already_cached])

    def flush(self) -> None:
        """Empties the cache; only valid while no request holds KV."""
        self.tree_cache.reset()
        self.allocator.reset()
