"""After every step, running requests free the sliding layers' KV that fell out of their
window (models with sliding-window layers over a hybrid pool only).

The one place it happens: at the end of ``Scheduler.step``, for every request that holds a
row (the running ones and the chunked one), whatever the step was (an extend, a prompt
chunk, a decode step, or an overlapped decode step still in flight: its requests'
``kv_len`` already counts the token it computes, and ``release_window`` keeps what that
token's query reads). Each request's part is ``WindowedRequestMemory.release_window``; the
count of local slots freed goes into the scheduler's stats.
"""

from __future__ import annotations

from radixlm.runtime.scheduler.scheduler_state import SchedulerState
from radixlm.runtime.scheduler.windowed_memory import WindowedRequestMemory


class WindowRelease:
    """Frees out-of-window local KV of the requests that hold rows, once per step."""

    def __init__(self, state: SchedulerState, memory: WindowedRequestMemory):
        self.state = state
        self.memory = memory
        self.freed_local_slots = 0
        """Local slots freed so far (a counter for ``server_info``)."""
        self.peak_local_in_use = 0
        """The most local slots in use at the end of a step, after the release: the
        running requests' windows, and what the radix cache keeps (``server_info``)."""

    def after_step(self) -> None:
        state = self.state
        reqs = state.running if state.chunked is None else [*state.running, state.chunked]
        for req in reqs:
            self.freed_local_slots += self.memory.release_window(req)
        local = self.memory.allocator.local
        self.peak_local_in_use = max(self.peak_local_in_use,
                                     local.size - local.available_size())

    def info(self) -> dict:
        """The local pool, as plain data (``server_info``)."""
        memory = self.memory
        local = memory.allocator.local
        tree = memory.tree_cache
        return {
            "window": memory.window,
            "local_kv_tokens": local.size,
            "free_local_kv_tokens": local.available_size(),
            "cache_local_evictable_tokens": (tree.local_evictable_size()
                                             if hasattr(tree, "local_evictable_size") else 0),
            "freed_local_slots": self.freed_local_slots,
            "peak_local_in_use": self.peak_local_in_use,
        }
