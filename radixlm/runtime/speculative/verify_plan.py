"""How many draft tokens a verify step should check: as many as pay for their rows.

A verify step runs k + 1 decode rows for a request with k draft tokens, and a pass of more
rows costs more: on a CPU little more for a few rows, then more once a product leaves its
few-row kernel; a batch already keeps the arithmetic busy. A draft token pays when the
tokens it is expected to add outweigh what its row adds to the pass. ``StepCosts`` learns
a step's seconds by its rows as the server runs; ``plan_drafts`` keeps, over the whole
batch, the draft tokens most likely to be accepted, as many as maximise the expected tokens
per second of the step (none: the step decodes plainly).

A request's chance that its j-th draft token is accepted is taken as ``rate ** j``, its
per-token acceptance rate (``DraftLength.rate``). A rows count never measured is assumed to
cost what the nearest measured one below it does (optimism, so that larger passes get tried
and measured), or is interpolated between two measured ones.
"""

from __future__ import annotations

import bisect

from radixlm.runtime.speculative.draft_tree import Draft

COST_DECAY = 0.2
"""Weight of a new measurement in a rows count's running cost."""


class StepCosts:
    """Seconds of a decode step by its rows, as running averages (invariant: ``rows`` is
    sorted, one entry per measured rows count)."""

    def __init__(self):
        self.rows: list[int] = []
        self.seconds: dict[int, float] = {}

    def observe(self, rows: int, seconds: float) -> None:
        known = self.seconds.get(rows)
        if known is None:
            bisect.insort(self.rows, rows)
            self.seconds[rows] = seconds
        else:
            self.seconds[rows] = known + COST_DECAY * (seconds - known)

    def estimate(self, rows: int) -> float | None:
        """The cost of a step of ``rows`` rows; None before any measurement at or below."""
        known = self.seconds.get(rows)
        if known is not None:
            return known
        at = bisect.bisect_left(self.rows, rows)
        if at == 0:
            return None
        low = self.rows[at - 1]
        if at == len(self.rows):
            return self.seconds[low]
        high = self.rows[at]
        share = (rows - low) / (high - low)
        return self.seconds[low] + share * (self.seconds[high] - self.seconds[low])


def plan_drafts(drafts: list[Draft], rates: list[float], costs: StepCosts) -> None:
    """Cuts ``drafts`` (in place) to the nodes that maximise the step's expected tokens per
    second (``rates``: each request's per-token acceptance rate). Without a measured cost
    for a plain step of these requests, the drafts stay as they are."""
    base = len(drafts)
    plain = costs.estimate(base)
    if plain is None or plain <= 0:
        return
    candidates = sorted(((chance, i) for i, (draft, rate) in enumerate(zip(drafts, rates))
                         for chance in node_chances(draft, rate)),
                        reverse=True)  # each request's in order: its chances only fall
    best, best_count, expected = base / plain, 0, float(base)
    for count, (chance, _) in enumerate(candidates, 1):
        expected += chance
        cost = costs.estimate(base + count)
        if cost is not None and cost > 0 and expected / cost > best:
            best, best_count = expected / cost, count
    kept = [0] * base
    for _, i in candidates[:best_count]:
        kept[i] += 1
    for draft, keep in zip(drafts, kept):
        draft.truncate(keep)


def node_chances(draft: Draft, rate: float) -> list[float]:
    """The chance that each node of ``draft`` is accepted, made non-increasing in node
    order (so that the best nodes of a draft are always a first part of it, which
    ``Draft.truncate`` keeps): ``rate ** depth`` on the main chain; a node of another
    branch, leaving the chain at depth f, ``rate ** (f - 1) * (1 - rate) / 2`` times
    ``rate`` per node below f (the chain's guess failed there, and the branch's is one of
    several)."""
    chances: list[float] = []
    main, depths = draft.main_length, draft.depths()
    fork_depth: dict[int, int] = {}
    for node, parent in enumerate(draft.parents):
        if node < main:
            chance = rate ** depths[node]
        else:
            fork = fork_depth[node] = fork_depth.get(parent, depths[node])
            chance = rate ** (fork - 1) * (1 - rate) / 2 * rate ** (depths[node] - fork)
        chances.append(min(chance, chances[-1]) if chances else chance)
    return chances
