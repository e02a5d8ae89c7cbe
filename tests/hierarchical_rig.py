"""A hierarchical prefix cache (``radixlm/kv_cache/hierarchical_cache.py``) over real pieces,
for the tests of ``tests/kv_cache/test_hierarchical_cache*.py``.

A small allocator and MHA pool (float32, CPU), the host tier and, where a test asks, a real
disk tier in a temporary directory. Every "request" writes at its slots the KV a model would:
a function of the whole token prefix up to each position and of the namespace (``kv_of``,
a chained hash), so any KV found in the pool, the host tier or a file can be checked against
what a fresh computation would have written.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch

from radixlm.kv_cache.allocator import TokenToKVPoolAllocator, pages_for
from radixlm.kv_cache.disk_kv_store import DiskKVStore, StoreIdentity
from radixlm.kv_cache.hierarchical_cache import HierarchicalCache
from radixlm.kv_cache.host_kv_blocks import HostKVBlocks
from radixlm.kv_cache.memory_pool import MHATokenToKVPool
from radixlm.kv_cache.radix_tree import RadixCache

LAYERS, HEADS, DIM = 2, 1, 4
VALUES = 2 * LAYERS * HEADS * DIM  # per token: K and V of every layer


# ---- the KV a model would compute -------------------------------------------------------------


@functools.lru_cache(maxsize=1 << 16)
def _digest(ns: str | None, prefix: tuple[int, ...]) -> bytes:
    above = _digest(ns, prefix[:-1]) if prefix else repr(ns).encode()
    if not prefix:
        return hashlib.blake2b(above, digest_size=2 * VALUES).digest()
    return hashlib.blake2b(above + prefix[-1].to_bytes(8, "little", signed=True),
                           digest_size=2 * VALUES).digest()


def kv_of(ns: str | None, tokens, start: int = 0) -> torch.Tensor:
    """(len(tokens) - start, VALUES) float32: the KV of positions ``start..`` of ``tokens``,
    each a function of the namespace and the whole prefix up to it (integers < 2**16, exact)."""
    tokens = tuple(tokens)
    rows = [torch.frombuffer(bytearray(_digest(ns, tokens[: i + 1])), dtype=torch.int16)
            for i in range(start, len(tokens))]
    if not rows:
        return torch.empty((0, VALUES))
    return torch.stack(rows).to(torch.float32)


def write_kv(pool: MHATokenToKVPool, slots: torch.Tensor, kv: torch.Tensor) -> None:
    for b, buffer in enumerate(pool.layer_buffers()):
        pool.write_rows(buffer, slots, kv[:, b * HEADS * DIM:(b + 1) * HEADS * DIM]
                        .reshape(-1, HEADS, DIM))


def read_kv(pool: MHATokenToKVPool, slots: torch.Tensor) -> torch.Tensor:
    return torch.cat([b.index_select(0, slots).reshape(len(slots), HEADS * DIM)
                      for b in pool.layer_buffers()], dim=1)


def block_kv(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A host or disk block (one tensor per pool buffer) as (block_tokens, VALUES)."""
    return torch.cat([t.reshape(t.shape[0], -1) for t in tensors], dim=1)


def assert_kv(pool, slots: torch.Tensor, ns: str | None, tokens, start: int = 0) -> None:
    got, expected = read_kv(pool, slots), kv_of(ns, tokens, start)
    assert torch.equal(got, expected), f"wrong KV for {len(tokens)} tokens in namespace {ns!r}"


# ---- a cache over real pieces, and requests that compute ---------------------------------------


class Rig:
    """A ``HierarchicalCache`` over a real allocator, MHA pool, host tier (and disk tier)."""

    def __init__(self, page: int = 1, block: int = 4, slots: int = 64, host_blocks: int = 32,
                 write_through: bool = False, min_load_tokens: int = 1,
                 disk_dir: Path | None = None, disk_bytes: int = 1 << 22):
        self.page, self.block = page, block
        self.allocator = TokenToKVPoolAllocator(slots, page)
        self.pool = MHATokenToKVPool(slots + page, LAYERS, HEADS, DIM, torch.float32, "cpu")
        self.tree = RadixCache(self.allocator, page)
        self.host = HostKVBlocks(self.pool, block, host_blocks)
        self.identity = StoreIdentity.of_pool(self.pool, model="test/tiny", tokenizer="tok-v1",
                                              page_size=page, block_tokens=block)
        self.disk = (DiskKVStore(disk_dir, self.identity, disk_bytes)
                     if disk_dir is not None else None)
        self.cache = HierarchicalCache(self.tree, self.pool, self.host, self.disk,
                                       self.identity.fingerprint(), write_through,
                                       min_load_tokens)
        self.held = 0  # slots held by requests outside the tree
        self.locked: list = []

    def serve(self, tokens, ns: str | None = None, load: bool = True,
              keep_locked: bool = False) -> tuple[int, int]:
        """Admits a request for ``tokens`` (loading from the lower tiers first when ``load``),
        checks the KV its match finds, computes the rest, caches it; returns (tokens loaded,
        tokens matched)."""
        tokens = list(tokens)
        loaded = self.cache.load_back(tokens, ns) if load else 0
        match = self.cache.match_prefix(tokens, ns)
        cached = len(match.indices)
        assert cached >= loaded
        assert_kv(self.pool, match.indices, ns, tokens[:cached])
        self.cache.inc_lock_ref(match.last_node)
        need = pages_for(len(tokens) - cached, self.page)
        if self.allocator.available_size() < need:
            self.cache.evict(need - self.allocator.available_size())
        fresh = self.allocator.alloc(len(tokens) - cached)
        write_kv(self.pool, fresh, kv_of(ns, tokens, cached))
        indices = torch.cat([match.indices, fresh])
        already = self.cache.insert(tokens, indices, ns)
        aligned = len(tokens) - len(tokens) % self.page
        self.allocator.free(indices[cached:already])
        self.allocator.free(indices[aligned:])
        if keep_locked:
            self.locked.append(match.last_node)
        else:
            self.cache.dec_lock_ref(match.last_node)
        return loaded, cached

    def lock(self, tokens, ns: str | None = None) -> None:
        """Locks the cached prefix of ``tokens`` as a running request would."""
        match = self.cache.match_prefix(list(tokens), ns)
        self.cache.inc_lock_ref(match.last_node)
        self.locked.append(match.last_node)

    def matched(self, tokens, ns: str | None = None) -> int:
        """How many tokens of ``tokens`` L1 holds, their KV checked."""
        match = self.cache.match_prefix(list(tokens), ns)
        assert_kv(self.pool, match.indices, ns, list(tokens)[: len(match.indices)])
        return len(match.indices)

    def evict_all(self) -> None:
        self.cache.evict(self.allocator.size)
        assert self.cache.evictable_size() == 0

    def drain(self) -> None:
        """Waits for the disk worker's queue (one thread: a no-op runs after what came before)."""
        if self.cache._worker is not None:
            self.cache._worker.submit(lambda: None).result()

    def host_block_is(self, tokens, ns: str | None, index: int) -> bool:
        """Whether the host tier holds block ``index`` of ``tokens`` with the right KV."""
        key = self.cache.block_keys(list(tokens), ns)[index]
        tensors = self.host.block_tensors(key)
        if tensors is None:
            return False
        end = (index + 1) * self.block
        assert torch.equal(block_kv(tensors), kv_of(ns, list(tokens)[:end], end - self.block))
        return True

    def scribble_free_slots(self) -> None:
        """Overwrites the KV of every free slot, so nothing found there later is a leftover."""
        free = self.allocator._page_slots(list(self.allocator._free_pages))
        for buffer in self.pool.layer_buffers():
            buffer[free] = float("nan")

    def check_accounting(self) -> None:
        assert (self.allocator.available_size() + self.cache.total_size() + self.held
                == self.allocator.size)
        assert self.cache.evictable_size() + self.cache.protected_size() == self.cache.total_size()
        if not self.locked:
            assert self.cache.protected_size() == 0


def prompt(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


