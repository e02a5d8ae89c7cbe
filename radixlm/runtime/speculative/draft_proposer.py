"""The interface between the verify step and whatever proposes draft tokens, and the
per-request draft length that follows acceptance.

A proposer is asked, once per verify step, for each running request's draft: at most the
budget the step gives it (what memory, the output limit and the context leave), possibly
nothing. What it keeps per request lives on the request (``Req.drafting``), so it
goes with it. After the step it is told how much of each draft was accepted, so that it can
draft less for requests whose drafts fail. ``may_propose`` answers, before a request's
last token is known on the host, whether a draft could come: overlap scheduling keeps
running ahead only while no request may speculate.

The seam for proposers that read the target model's hidden states (EAGLE-style heads):
``after_verify`` receives the verify pass's hidden rows of the tokens each request kept.
The n-gram proposer ignores them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from radixlm.runtime.request import Req
from radixlm.runtime.speculative.draft_tree import Draft

PROBE_EVERY = 16
"""Output tokens a request whose draft length fell to zero (or whose last lookup found no
draft) decodes plainly before it looks up a draft again (open-ended text stops paying for
drafts, but a quote may begin)."""


RATE_DECAY = 0.7
"""Weight of the past in a request's acceptance rate, per verify step."""


class DraftProposer(Protocol):
    def propose(self, reqs: list[Req], budgets: list[int]) -> list[Draft]:
        """Each request's draft (``draft_tree.Draft``: a chain, or a token tree), none
        deeper than its budget (0: none)."""

    def may_propose(self, req: Req) -> bool:
        """Whether ``req`` might get a draft at its next step."""

    def observe(self, req: Req, proposed: int, accepted: int) -> None:
        """``accepted`` of the ``proposed`` draft tokens were the target's."""

    def acceptance_rate(self, req: Req) -> float:
        """The chance that ``req``'s next draft token is accepted, as seen so far."""

    def after_verify(self, reqs: list[Req], hidden: torch.Tensor,
                     kept_rows: list[list[int]]) -> None:
        """The verify pass's hidden states (T, H) and, per request, the rows of the tokens
        it kept (for proposers that draft from the target's hidden states)."""

    def close(self) -> None:
        """Releases what the proposer holds (a draft model's runner)."""


@dataclass
class DraftLength:
    """How many tokens to draft for one request next (invariant: ``0 <= length <= limit``),
    with the request's output length as its clock.

    A fully accepted draft lengthens the next by one; a partly accepted one sets it to one
    more than was accepted; a draft rejected at its first token halves it. At zero the
    request looks up nothing, but for a one-token probe every ``PROBE_EVERY`` output tokens.
    ``may_draft`` (asked before a step that overlap scheduling could run ahead) also says
    no after a lookup that found nothing, until the next probe: a request that never gets
    a draft does not hold the host back at every step."""

    limit: int
    length: int = -1
    found: bool = True
    """Whether the last lookup found a draft."""
    looked_at: int = 0
    """The output length at the last lookup."""
    successes: float = 1.0
    trials: float = 2.0
    """Draft tokens accepted, and checked up to the first rejection, decayed by
    ``RATE_DECAY`` a verify (a prior of one in two)."""

    def __post_init__(self) -> None:
        if self.length < 0:
            self.length = self.limit

    def next(self, position: int) -> int:
        """The draft length to look up at output length ``position`` (0: no lookup)."""
        if self.length > 0:
            self.looked_at = position
            return self.length
        if position - self.looked_at >= PROBE_EVERY:
            self.looked_at = position
            return 1
        return 0

    def may_draft(self, position: int) -> bool:
        return (self.length > 0 and self.found) or position - self.looked_at >= PROBE_EVERY

    def note_found(self, found: bool) -> None:
        """What the lookup ``next`` asked for found."""
        self.found = found

    @property
    def rate(self) -> float:
        """The per-token acceptance rate: accepted / checked."""
        return self.successes / self.trials

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        self.successes = RATE_DECAY * self.successes + accepted
        self.trials = RATE_DECAY * self.trials + accepted + (accepted < proposed)
        if accepted == proposed:
            self.length = min(self.limit, max(self.length, proposed) + 1)
        elif accepted > 0:
            self.length = min(self.limit, accepted + 1)
        else:
            self.length //= 2
