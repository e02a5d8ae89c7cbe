"""Request memory over a hybrid pool: a request frees its sliding layers' KV as it falls out
of the window (``kv_cache/hybrid_pool.py``, ``kv_cache/windowed_radix_tree.py``).

Ownership is ``RequestMemory``'s, slot for slot: a request slot and its local slot are held
by the same party, and free with it (``HybridAllocator.free``). On top of it:

- ``release_window(req)`` (after every step, ``window_release.py``) frees the local KV of
  the request's own whole pages below ``kv_len - W``: no query still to come reads them
  (the next query is at ``kv_len`` or, with a decode step in flight, ``kv_len - 1``, and
  sees keys from ``query - W + 1`` on). Tokens of its tree prefix are the tree's: the
  request never frees those; it holds a window lock on its prefix's last node while its
  window still reaches into the prefix, so the tree keeps their local KV.
- Beam searches share pages between members (``beam_groups.py``) only at the same positions
  and all members have the same ``kv_len``: a shared page is dead for every member at once,
  so freeing its local KV from any member's row is safe (and a second free is a no-op).
  The prompt before the leader's tree prefix is the leader's: followers start there too.
- ``_make_room`` evicts the tree's local KV (``evict_local``) when the local pool is short,
  besides full KV when the full pool is.

Invariant (with ``RequestMemory``'s): a running request holds the local KV of every token
from ``floor_page(kv_len - W)`` on, its own or, under its window lock, the tree's.
"""

from __future__ import annotations

import weakref

from radixlm.kv_cache.allocator import TokenToKVPoolAllocator
from radixlm.kv_cache.base import MatchResult, PrefixCache
from radixlm.kv_cache.hybrid_pool import HybridAllocator
from radixlm.kv_cache.memory_pool import ReqToTokenPool
from radixlm.kv_cache.no_cache import NoPrefixCache
from radixlm.kv_cache.radix_tree import RadixCache
from radixlm.kv_cache.windowed_radix_tree import WindowedRadixCache
from radixlm.runtime.request import Req
from radixlm.runtime.scheduler.request_memory import RequestMemory


def build_request_memory(req_to_token_pool: ReqToTokenPool,
                         allocator: TokenToKVPoolAllocator, window: int | None,
                         disable_radix_cache: bool) -> RequestMemory:
    """The request memory and prefix cache over the runner's pools: windowed where the
    sliding layers keep only their window (``window``: W, and ``allocator`` a
    ``HybridAllocator``), else plain."""
    page = allocator.page_size
    if window is None:
        cache_class = NoPrefixCache if disable_radix_cache else RadixCache
        return RequestMemory(req_to_token_pool, allocator, cache_class(allocator, page))
    tree = (NoPrefixCache(allocator, page) if disable_radix_cache
            else WindowedRadixCache(allocator, page, window))
    return WindowedRequestMemory(req_to_token_pool, allocator, tree, window)


class WindowedRequestMemory(RequestMemory):
    """``RequestMemory`` whose requests free local KV out of their window (module docstring).

    ``tree_cache``: a ``WindowedRadixCache``, or ``NoPrefixCache`` (nothing shared, no
    window locks).
    """

    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: HybridAllocator,
                 tree_cache: PrefixCache, window: int):
        super().__init__(req_to_token_pool, allocator, tree_cache)
        self.window = window
        self._locks_windows = hasattr(tree_cache, "lock_window")
        # Keyed by the request weakly: a beam search's followers leave without ``release``.
        self._window_node: weakref.WeakKeyDictionary[Req, object] = weakref.WeakKeyDictionary()
        """request -> the node its window lock is on."""
        self._released: weakref.WeakKeyDictionary[Req, int] = weakref.WeakKeyDictionary()
        """request -> the position up to which its own local KV was freed."""

    # ---- the window ---------------------------------------------------------------------

    def release_window(self, req: Req) -> int:
        """Frees the local KV of the request's own whole pages below ``kv_len - W`` not yet
        freed, drops its window lock once its window has left its prefix; returns the local
        slots freed."""
        if req.req_pool_idx is None:
            return 0
        page = self.page_size
        end = max(0, req.kv_len - self.window) // page * page
        released = self._released.get(req, 0)
        if released > end:  # from an earlier run (a beam follower retracted with its group)
            released = 0
        start = max(self._own_start(req), released)
        freed = 0
        if end > start:
            slots = self.req_to_token[req.req_pool_idx, start:end]
            freed = self.allocator.release_local(slots)
            self._released[req] = end
        self._sync_window_lock(req)
        return freed

    def _own_start(self, req: Req) -> int:
        """Where the request's own slots start: after its tree prefix (a beam search's
        follower: after its leader's)."""
        owner = req.beam.leader if req.beam is not None else req
        prefix = owner.prefix_indices
        return 0 if prefix is None else len(prefix)

    def _sync_window_lock(self, req: Req) -> None:
        """Holds a window lock on the request's prefix node exactly while its window
        reaches into the prefix."""
        if not self._locks_windows:
            return
        prefix = req.prefix_indices
        wanted = None
        if prefix is not None and len(prefix):
            dead = max(0, req.kv_len - self.window) // self.page_size * self.page_size
            if dead < len(prefix):
                wanted = req.last_node
        held = self._window_node.get(req)
        if held is wanted:
            return
        if held is not None:
            self.tree_cache.unlock_window(held)
            del self._window_node[req]
        if wanted is not None:
            self.tree_cache.lock_window(wanted)
            self._window_node[req] = wanted

    def _drop_window(self, req: Req) -> None:
        held = self._window_node.pop(req, None)
        if held is not None:
            self.tree_cache.unlock_window(held)
        self._released.pop(req, None)

    # ---- RequestMemory's transfers, with the window's bookkeeping -----------------------

    def match_and_lock(self, req: Req, match: MatchResult | None = None) -> None:
        super().match_and_lock(req, match)
        self._sync_window_lock(req)

    def unlock(self, req: Req) -> None:
        self._drop_window(req)
        super().unlock(req)

    def cache_unfinished(self, req: Req) -> None:
        held = self._window_node.pop(req, None)
        if held is not None:  # the lock moves with the prefix
            self.tree_cache.unlock_window(held)
        super().cache_unfinished(req)
        self._sync_window_lock(req)

    def _match_inserted(self, tokens: list[int], extra_key: str | None) -> MatchResult:
        # The request holds the window of what it inserted itself: no cut.
        if self._locks_windows:
            return self.tree_cache.match_inserted(tokens, extra_key)
        return super()._match_inserted(tokens, extra_key)

    def release(self, req: Req) -> None:
        self._drop_window(req)
        super().release(req)

    def discard(self, req: Req) -> None:
        self._drop_window(req)
        super().discard(req)

    def _make_room(self, slots: int) -> None:
        super()._make_room(slots)
        shortfall = slots - self.allocator.local_available_size()
        if shortfall > 0 and self._locks_windows:
            self.tree_cache.evict_local(shortfall)

    def own_local_slots(self, reqs: list[Req]) -> int:
        """The local slots ``reqs`` hold beyond their tree prefix (a measurement)."""
        total = 0
        for req in reqs:
            if req.req_pool_idx is not None and req.kv_len > self._own_start(req):
                row = self.req_to_token[req.req_pool_idx, self._own_start(req): req.kv_len]
                total += int(self.allocator.local_held(row).sum())
        return total

    def local_slots_in_use(self) -> int:
        """Local slots held, by requests and the tree."""
        local = self.allocator.local
        return local.size - local.available_size()

    def flush(self) -> None:
        self._window_node.clear()
        self._released.clear()
        super().flush()

