"""Freed heap pages go back to the system when a process trims after a busy spell."""

from __future__ import annotations

import pytest

from radixlm.runtime import free_memory
from radixlm.runtime.free_memory import IdleTrim, return_free_memory

pytestmark = pytest.mark.skipif(free_memory._LIBC is None, reason="needs glibc's malloc_trim")


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        return int(next(l for l in status if l.startswith("VmRSS:")).split()[1]) / 1024


def test_trimming_returns_the_pages_of_freed_buffers():
    # 100 KB buffers come from malloc's heap (below its mmap threshold); keeping every
    # tenth alive pins the heap's top, so freeing the rest returns nothing by itself.
    buffers = [bytearray(100_000) for _ in range(3000)]
    kept = buffers[::10]
    del buffers
    before = rss_mib()
    return_free_memory()
    assert before - rss_mib() > 150  # of the ~260 MiB freed
    assert kept


def test_idle_trim_trims_once_per_busy_spell(monkeypatch):
    calls = []
    monkeypatch.setattr(free_memory, "return_free_memory", lambda: calls.append(1))
    trim = IdleTrim()
    trim.idle()
    assert calls == []
    trim.busy()
    trim.busy()
    trim.idle()
    trim.idle()
    assert calls == [1]
