"""Draft tokens without a draft model: from the request's own tokens and from the radix tree.

Two sources, tried in order for each request:

1. The radix tree (``PrefixCache.continuation``): the tokens cached right after the
   request's whole sequence, prompt and output so far. They are what an earlier request with
   the same context said next: the same question asked again, a sibling sample of an ``n > 1``
   call that finished first, a regeneration. A match there is of the whole context, so it is
   tried first.
2. The request's own tokens (``NgramIndex``): the longest suffix of its sequence (between the
   minimum and the maximum match window) that occurred before in it; the tokens that followed
   its latest earlier occurrence are the draft. Quoting, summarising or editing a given text,
   filling JSON from a given document, repeating a tool's output: the output copies spans
   of the prompt.

Each request's draft length follows its acceptance (``DraftLength``). Everything here runs on
the host, from token lists the scheduler keeps anyway; a step costs each request one tree
walk (the length of its sequence, in whole edges) and a few dictionary lookups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixlm.kv_cache.base import PrefixCache
from radixlm.runtime.request import Req
from radixlm.runtime.speculative.draft_proposer import DraftLength
from radixlm.runtime.speculative.draft_tree import Draft


class NgramIndex:
    """Where each n-gram (``min_n <= n <= max_n`` tokens) of one growing token sequence
    last ended (its latest ``keep`` ends), indexed as the sequence grows (invariant: every
    n-gram ending before the sequence's last position seen by ``propose`` is indexed; the
    sequence's own suffix is not, so a lookup finds an earlier occurrence)."""

    def __init__(self, min_n: int, max_n: int, keep: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram windows need 1 <= min <= max, got {min_n}, {max_n}")
        self.min_n, self.max_n, self.keep = min_n, max_n, keep
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}  # oldest first
        self._indexed = 0  # n-grams ending at positions below this are indexed

    def extend(self, tokens: Sequence[int]) -> None:
        """Appends ``tokens`` to the sequence."""
        self.tokens += tokens

    def propose(self, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` tokens that followed the latest earlier occurrence of the
        longest suffix of the sequence that occurred before; [] when none did."""
        found = self.propose_branches(max_tokens, 1)
        return found[0] if found else []

    def propose_branches(self, max_tokens: int, max_branches: int) -> list[list[int]]:
        """Up to ``max_branches`` distinct continuations (each up to ``max_tokens``) of
        the sequence's suffix: after the longest suffix that occurred before, latest
        occurrence first, then after shorter suffixes' occurrences."""
        self._index()
        tokens, ends = self.tokens, self._ends
        length = len(tokens)
        branches: list[list[int]] = []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            for end in reversed(ends.get(tuple(tokens[length - n :]), ())):
                branch = tokens[end : end + max_tokens]
                if branch not in branches:
                    branches.append(branch)
                    if len(branches) == max_branches:
                        return branches
        return branches

    def _index(self) -> None:
        tokens, ends, keep = self.tokens, self._ends, self.keep
        for end in range(max(self._indexed, self.min_n), len(tokens)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                found = ends.setdefault(tuple(tokens[end - n : end]), [])
                found.append(end)
                if len(found) > keep:
                    del found[0]
        self._indexed = max(self._indexed, len(tokens))


@dataclass
class RequestDrafts:
    """What the proposer keeps per request (``Req.drafting``)."""

    length: DraftLength
    index: NgramIndex


class NgramProposer:
    """The ``DraftProposer`` of ``--speculative-algorithm NGRAM`` (see the module)."""

    def __init__(self, tree: PrefixCache | None, max_draft: int, min_window: int,
                 max_window: int, max_breadth: int = 1):
        """``tree`` None: drafts come from the requests' own tokens only. ``max_breadth``
        above 1: token trees of up to that many branches, ``max_draft`` nodes and as many
        levels as the request's ``DraftLength``."""
        self.tree = tree
        self.max_draft = max_draft
        self.min_window, self.max_window = min_window, max_window
        self.max_breadth = max_breadth

    def propose(self, reqs: list[Req], budgets: list[int]) -> list[Draft]:
        drafts = []
        for req, budget in zip(reqs, budgets):
            length = self._length(req)
            wanted = min(length.next(len(req.output_ids)), budget)
            draft = self._draft(req, wanted) if wanted > 0 else Draft()
            if wanted > 0:
                length.note_found(bool(draft))
            drafts.append(draft)
        return drafts

    def may_propose(self, req: Req) -> bool:
        return self._length(req).may_draft(len(req.output_ids))

    def observe(self, req: Req, proposed: int, accepted: int) -> None:
        self._length(req).observe(proposed, accepted)

    def acceptance_rate(self, req: Req) -> float:
        return self._length(req).rate

    def after_verify(self, reqs: list[Req], hidden: torch.Tensor,
                     kept_rows: list[list[int]]) -> None:
        """(n-grams read no hidden states)"""

    def close(self) -> None:
        """(nothing to release)"""

    def _state(self, req: Req) -> RequestDrafts:
        if req.drafting is None:
            req.drafting = RequestDrafts(
                DraftLength(self.max_draft),
                NgramIndex(self.min_window, self.max_window, self.max_breadth))
        return req.drafting

    def _length(self, req: Req) -> DraftLength:
        return self._state(req).length

    def _draft(self, req: Req, wanted: int) -> Draft:
        """A chain of ``wanted`` tokens (from the tree, else the request's own tokens) or,
        with ``max_breadth`` above 1, a tree of ``wanted`` levels and up to ``max_draft``
        nodes: the branches of both sources, the tree's first."""
        breadth, branches = self.max_breadth, []
        if self.tree is not None:
            branches = self.tree.continuations(req.all_ids(), wanted, breadth, req.extra_key)
            if branches and breadth == 1:
                return Draft.chain(branches[0])
        index = self._state(req).index
        seen, prompt = len(index.tokens), len(req.input_ids)
        if seen < prompt:
            index.extend(req.input_ids[seen:])
            seen = prompt
        index.extend(req.output_ids[seen - prompt :])
        branches += index.propose_branches(wanted, breadth - len(branches))
        return Draft.from_branches(branches, self.max_draft)
