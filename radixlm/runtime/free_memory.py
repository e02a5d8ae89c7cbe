"""Handing a process's free heap pages back to the system.

A busy spell leaves freed buffers of up to 32 MB each in malloc's arenas (glibc serves
allocations below its adaptive mmap threshold from them: attention scores of long prompts,
logits, large request bodies), where they stay counted in the process's RSS while it
idles. ``return_free_memory`` trims them (glibc's ``malloc_trim``; a no-op elsewhere); the
scheduler calls it on its first idle turn after work, the RequestTracker at its first
scheduler heartbeat with no request in flight. Start-up leaves the same: parsing a
tokenizer's JSON (tokenizers' own parser, in Rust) frees about twice what the tokenizer
then holds, so every process trims once it has loaded what it serves with.
"""

from __future__ import annotations

import ctypes


def _load_libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 (glibc only)
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _load_libc()


def return_free_memory() -> None:
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


class IdleTrim:
    """Trims once per busy spell: ``busy()`` marks work, ``idle()`` trims if there was any
    since the last trim."""

    def __init__(self):
        self.dirty = False

    def busy(self) -> None:
        self.dirty = True

    def idle(self) -> None:
        if self.dirty:
            self.dirty = False
            return_free_memory()
