"""Microbenchmark: RadixCache.match_prefix / insert against a naive linear-scan prefix cache.

The workload mixes what a server sees: shared system prompts (~300 tokens), few-shot prompts
(~1,000 shared example tokens plus a distinct question) and multi-turn chats, where each turn
extends the previous conversation. Requests from these streams are interleaved, and each is
served like the engine would: ``match_prefix(prompt)`` then ``insert(prompt + output)``. The
allocator is big enough that nothing is evicted; eviction is timed separately at the end.

Run: ``python benchmarks/bench_radix_tree.py``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixlm.kv_cache.allocator import TokenToKVPoolAllocator
from radixlm.kv_cache.radix_tree import RadixCache

VOCAB = 32_000
SEED = 0


@dataclass
class Request:
    prompt: tuple[int, ...]
    output: tuple[int, ...]


def build_workload(rng: random.Random) -> list[Request]:
    """Interleaves the request streams; requests within one chat keep their order."""

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(VOCAB) for _ in range(n))

    system_prompts = [tokens(300) for _ in range(4)]
    examples = [tokens(1000) for _ in range(3)]
    streams: list[list[Request]] = []
    for i in range(150):  # few-shot: system prompt + shared examples + a distinct question
        prompt = system_prompts[i % 4] + examples[i % 3] + tokens(rng.randint(30, 80))
        streams.append([Request(prompt, tokens(rng.randint(20, 60)))])
    for i in range(200):  # single-turn chat on a shared system prompt
        prompt = system_prompts[i % 4] + tokens(rng.randint(50, 200))
        streams.append([Request(prompt, tokens(rng.randint(50, 200)))])
    for i in range(80):  # multi-turn chat: each turn's prompt is the whole history so far
        history, turns = system_prompts[i % 4], []
        for _ in range(8):
            prompt = history + tokens(rng.randint(30, 100))
            output = tokens(rng.randint(50, 200))
            turns.append(Request(prompt, output))
            history = prompt + output
        streams.append(turns)
    requests = []
    while streams:
        stream = rng.choice(streams)
        requests.append(stream.pop(0))
        if not stream:
            streams.remove(stream)
    return requests


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    if a[:n] == b[:n]:
        return n
    i = 1
    while a[i] == b[i]:
        i += 1
    return i


class NaivePrefixCache:
    """The baseline: a list of cached sequences scanned linearly for the longest prefix."""

    def __init__(self) -> None:
        self.entries: list[tuple[tuple[int, ...], torch.Tensor]] = []

    def _longest(self, key: tuple[int, ...]) -> tuple[int, torch.Tensor | None]:
        best_len, best = 0, None
        for seq, indices in self.entries:
            n = common_prefix_len(seq, key)
            if n > best_len:
                best_len, best = n, indices
        return best_len, best

    def match_prefix(self, key: tuple[int, ...]) -> torch.Tensor:
        n, indices = self._longest(key)
        return indices[:n] if indices is not None else torch.empty(0, dtype=torch.int64)

    def insert(self, key: tuple[int, ...], indices: torch.Tensor) -> int:
        n, cached = self._longest(key)
        if n < len(key):
            head = cached[:n] if cached is not None else indices[:0]
            self.entries.append((key, torch.cat([head, indices[n:]])))
        return n


@dataclass
class Timing:
    ops: int = 0
    tokens: int = 0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.ops += 1
        self.tokens += tokens
        self.seconds += seconds


def run(cache, allocator: TokenToKVPoolAllocator, requests: list[Request]):
    """Serves every request; returns (match timing, insert timing, matched token counts)."""
    match, insert, matched = Timing(), Timing(), []
    for req in requests:
        t0 = time.perf_counter()
        result = cache.match_prefix(req.prompt)
        match.add(len(req.prompt), time.perf_counter() - t0)
        indices = result if isinstance(result, torch.Tensor) else result.indices
        matched.append(len(indices))
        full = req.prompt + req.output
        fresh = allocator.alloc(len(full))  # outside the timers: the allocator is not measured
        t0 = time.perf_counter()
        cached = cache.insert(full, fresh)
        insert.add(len(full), time.perf_counter() - t0)
        allocator.free(fresh[:cached])  # the caller frees duplicates (and the unaligned tail)
        allocator.free(fresh[len(full) - len(full) % allocator.page_size :])
    return match, insert, matched


def main() -> None:
    torch.set_num_threads(1)
    requests = build_workload(random.Random(SEED))
    total_tokens = sum(len(r.prompt) + len(r.output) for r in requests)
    print(f"{len(requests)} requests, {total_tokens} prompt+output tokens")

    rows: list[tuple[str, str, Timing, Timing | None]] = []
    naive_alloc = TokenToKVPoolAllocator(total_tokens + 16)
    naive_match, naive_insert, naive_matched = run(NaivePrefixCache(), naive_alloc, requests)
    for page_size in (1, 16):
        allocator = TokenToKVPoolAllocator(2 * total_tokens, page_size)
        cache = RadixCache(allocator, page_size)
        match, insert, matched = run(cache, allocator, requests)
        if page_size == 1:
            assert matched == naive_matched, "radix and naive disagree on matched lengths"
        name = f"radix p={page_size}"
        rows += [("match_prefix", name, match, naive_match), ("insert", name, insert, naive_insert)]
        size, evict = cache.total_size(), Timing()
        while cache.total_size():  # the engine evicts about one batch's worth at a time
            t0 = time.perf_counter()
            freed = cache.evict(256)
            evict.add(freed, time.perf_counter() - t0)
        rows.append(("evict(256)", name, evict, None))
        hit = sum(matched) / sum(len(r.prompt) for r in requests)
        print(f"{name}: cached {size} tokens, prompt-token hit rate {hit:.1%}")
    rows += [("match_prefix", "naive", naive_match, None), ("insert", "naive", naive_insert, None)]

    header = ("operation", "impl", "ops", "ops/s", "tokens/s", "radix/naive")
    print("\n{:<13} {:<11} {:>6} {:>10} {:>12} {:>11}".format(*header))
    for op, name, t, naive in sorted(rows, key=lambda r: (r[0], r[1] != "naive", r[1])):
        ratio = f"{naive.seconds / t.seconds:8.1f}x" if naive else ""
        print(
            f"{op:<13} {name:<11} {t.ops:>6} {t.ops / t.seconds:>10.0f} "
            f"{t.tokens / t.seconds:>12.3g} {ratio:>11}"
        )


if __name__ == "__main__":
    main()
