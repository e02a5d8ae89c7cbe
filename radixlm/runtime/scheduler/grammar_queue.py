"""Constrained requests waiting for their grammar to compile.

A request with a constraint is held here, not in the waiting queue, until its grammar's
compilation (in the backend's thread pool) is done; then it gets its own matcher and joins
the waiting queue. A request whose grammar is already compiled (a cache hit) skips the
queue. One whose grammar fails to compile ends with ``finish_reason`` abort naming the
problem (the Engine checks constraints before sending them, so this is a last guard).
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait

from radixlm.runtime.grammar.grammar_backend import GrammarBackend
from radixlm.runtime.request import Req, finish_abort

WAIT_S = 0.005
"""How long an otherwise idle scheduler blocks on pending compilations per step."""


class GrammarQueue:
    def __init__(self, backend: GrammarBackend):
        self.backend = backend
        self.pending: list[tuple[Req, Future]] = []

    def __len__(self) -> int:
        return len(self.pending)

    def reqs(self) -> list[Req]:
        return [req for req, _ in self.pending]

    def add(self, req: Req) -> bool:
        """Starts (or joins) the compilation of ``req``'s grammar; True if the request is
        ready at once (its matcher attached, or its failure recorded)."""
        future = self.backend.compile(req.grammar_key)
        if future.done():
            self._attach(req, future)
            return True
        self.pending.append((req, future))
        return False

    def pop_done(self) -> list[Req]:
        """The requests whose compilation has ended: ready ones with a matcher, failed
        ones finished (abort)."""
        # One look at each future: a compilation that ends between two looks would
        # otherwise leave its request in neither list.
        done, still = [], []
        for pair in self.pending:
            (done if pair[1].done() else still).append(pair)
        if not done:
            return []
        self.pending = still
        for req, future in done:
            self._attach(req, future)
        return [req for req, _ in done]

    def remove(self, req: Req) -> bool:
        """Drops ``req`` (an abort); False if it was not here."""
        before = len(self.pending)
        self.pending = [(r, f) for r, f in self.pending if r is not req]
        return len(self.pending) < before

    def wait(self, timeout: float = WAIT_S) -> None:
        """Blocks until a pending compilation ends, at most ``timeout`` seconds."""
        if self.pending:
            wait([future for _, future in self.pending], timeout, FIRST_COMPLETED)

    def _attach(self, req: Req, future: Future) -> None:
        error = future.exception()
        if error is not None:
            req.finish_reason = finish_abort(f"invalid constraint: {error}")
            return
        req.grammar = self.backend.new_matcher(future.result())
