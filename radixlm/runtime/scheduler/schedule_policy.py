"""The order in which waiting requests are considered for admission.

Policies:
- ``lpm``: longest cached prefix first, so the requests that compute least go first and
  the prefixes they reuse are touched (kept from eviction) while still useful. Above
  ``LPM_QUEUE_LIMIT`` waiting requests the matching costs more than it saves: ``fcfs``.
- ``dfs-weight``: depth-first over the radix tree, heavier subtrees (more waiting
  requests below) first, so requests sharing a prefix run back to back.
- ``fcfs``: arrival order. ``lof``: longest output budget first. ``random``.

For the cache-aware policies, a request whose cached prefix is short but which shares a
long prefix with a request ahead of it in this round is held back one round: the one ahead
computes the prefix, caches it, and the held request then reuses it instead of computing
it a second time in the same batch.
"""

from __future__ import annotations

import random
from collections import defaultdict

import torch

from radixlm.kv_cache.allocator import TokenToKVPoolAllocator
from radixlm.kv_cache.base import MatchResult, PrefixCache
from radixlm.kv_cache.radix_tree import RadixCache, TreeNode
from radixlm.runtime.request import Req
from radixlm.runtime.scheduling_options import SCHEDULE_POLICIES

LPM_QUEUE_LIMIT = 512
"""Above this many waiting requests, ``lpm`` and ``dfs-weight`` fall back to ``fcfs``: each
waiting request costs a prefix match a round (benchmarks/bench_radix_tree.py), so this
bounds a round's ordering to a few milliseconds (benchmarks/RESULTS.md)."""
IN_BATCH_CHECK_THRESHOLD = 32
"""Only requests with a cached prefix at most this long are checked against the round."""
IN_BATCH_MATCH_THRESHOLD = 32
"""A request sharing at least this many tokens with one ahead of it is held back."""


class SchedulePolicy:
    """Orders the waiting queue once per admission round."""

    def __init__(self, policy: str, tree_cache: PrefixCache, seed: int = 0):
        if policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {policy!r}")
        self.policy = policy
        self.tree_cache = tree_cache
        self.rng = random.Random(seed)

    def order(self, waiting: list[Req]) -> list[tuple[Req, MatchResult | None]]:
        """The waiting requests to try this round, in order, each with the cached prefix the
        policy matched for it (None where the policy matched nothing), which admission
        locks instead of matching again; held-back requests are left out."""
        policy = self.policy
        if policy in ("lpm", "dfs-weight") and (
            len(waiting) > LPM_QUEUE_LIMIT or not self.tree_cache.keeps_inserted
        ):
            policy = "fcfs"
        if policy == "fcfs":
            ordered = list(waiting)
        elif policy == "lof":
            ordered = sorted(waiting, key=lambda r: -r.sampling.max_new_tokens)
        elif policy == "random":
            ordered = list(waiting)
            self.rng.shuffle(ordered)
        if policy in ("fcfs", "lof", "random"):
            return [(req, None) for req in ordered]
        matches = {id(r): self.tree_cache.match_prefix(r.match_key(), r.extra_key) for r in waiting}
        if policy == "lpm":
            ordered = sorted(waiting, key=lambda r: -len(matches[id(r)].indices))
        else:
            ordered = _depth_first_by_weight(waiting, {k: m.last_node for k, m in matches.items()})
        return [(req, matches[id(req)]) for req in _hold_back_in_batch_duplicates(ordered, matches)]


def _depth_first_by_weight(waiting: list[Req], nodes: dict[int, TreeNode]) -> list[Req]:
    """Requests grouped under the tree node their cached prefix ends at, visited depth
    first with the subtrees holding more waiting requests first."""
    at_node: dict[int, list[Req]] = defaultdict(list)
    weight: dict[int, int] = defaultdict(int)
    for req in waiting:
        node = nodes[id(req)]
        at_node[id(node)].append(req)
        while node is not None:
            weight[id(node)] += 1
            node = node.parent
    root = nodes[id(waiting[0])]
    while root.parent is not None:
        root = root.parent
    ordered: list[Req] = []
    stack = [root]
    while stack:
        node = stack.pop()
        ordered += at_node.get(id(node), [])
        children = [c for c in node.children.values() if weight[id(c)] > 0]
        stack += sorted(children, key=lambda c: weight[id(c)])  # heaviest popped first
    return ordered


def _hold_back_in_batch_duplicates(ordered: list[Req], matches: dict) -> list[Req]:
    """Leaves out the requests that would recompute a prefix that one ahead of them
    computes in this same round."""
    scratch = RadixCache(TokenToKVPoolAllocator(1), page_size=1)
    kept: list[Req] = []
    for req in ordered:
        if len(matches[id(req)].indices) > IN_BATCH_CHECK_THRESHOLD:
            kept.append(req)
            continue
        key = req.match_key()
        shared = len(scratch.match_prefix(key, req.extra_key).indices)
        if shared < IN_BATCH_MATCH_THRESHOLD:
            scratch.insert(key, torch.zeros(len(key), dtype=torch.int64), req.extra_key)
            kept.append(req)
    return kept
