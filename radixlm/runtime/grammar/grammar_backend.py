"""The grammar backend's contract: compile constraints once, off the scheduler's loop, and
give each constrained request a matcher that masks its next token.

A constraint is a ``GrammarKey`` (kind, text, see ``constraints.py``): a regex, a JSON
schema or an EBNF grammar.
``GrammarBackend.compile`` returns a future; compiling runs in a small thread pool, so the
scheduler keeps stepping other requests while a grammar compiles, and every request with
the same key shares one compilation (the cache holds the future itself, so a second request
arriving mid-compilation waits on the same one).

``xgrammar_backend.py`` implements it on xgrammar; another backend (outlines, llguidance)
would implement the same two classes, and ``factory.py`` would name it.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from radixlm.runtime.grammar.constraints import GrammarKey

CACHE_ENTRIES = 1024
"""Compiled grammars kept (least recently used ones are dropped beyond this)."""
COMPILE_THREADS = 2
HOST = torch.device("cpu")


class GrammarMatcher(ABC):
    """One request's position in its grammar.

    Invariant kept by the scheduler: the matcher has accepted exactly the request's
    ``output_ids`` (in order), so retraction, which keeps the output, keeps the matcher
    valid, and re-admission needs no replay. ``rollback(n)`` undoes the last ``n``
    accepted tokens (jump-forward uses it to give back tokens that do not fit).
    """

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advances by one token; False (state unchanged) if the grammar forbids it."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undoes the last ``num_tokens`` accepted tokens."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed next tokens into ``bitmask[row]`` (state unchanged)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once a stop token was accepted at the end of a complete match."""

    @abstractmethod
    def is_completed(self) -> bool:
        """True when the text so far is a complete match (it may still be extended)."""

    @abstractmethod
    def jump_forward_string(self) -> str:
        """The longest text every continuation must start with ("" when there is a
        choice); whole characters only. State unchanged. Bounded work: a matcher that cannot
        bound the text's length cheaply returns "" (the caller then decodes token by
        token)."""


class GrammarBackend(ABC):
    """Compiles constraints against one tokenizer and applies their token masks.

    ``compile`` may be called from any thread; everything else from the scheduler's.
    """

    def __init__(self, vocab_size: int, threads: int = COMPILE_THREADS):
        self.vocab_size = vocab_size
        """Width of the model's logits (may exceed the tokenizer's vocabulary)."""
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="radixlm-grammar")
        self._cache: OrderedDict[GrammarKey, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._bitmask: torch.Tensor | None = None

    def compile(self, key: GrammarKey) -> Future:
        """A future of the compiled grammar for ``key`` (an exception if it is invalid);
        the same future for every call with an equal key while it stays cached."""
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._pool.submit(self._compile, key)
                self._cache[key] = future
                while len(self._cache) > CACHE_ENTRIES:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
            return future

    def bitmask(self, rows: int, device: torch.device = HOST) -> torch.Tensor:
        """A (rows, words) host bitmask buffer for logits on ``device``, grown as needed and
        reused across steps."""
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            self._bitmask = self.allocate_bitmask(max(rows, 8), device)
        return self._bitmask[:rows]

    def mask_logits(self, logits: torch.Tensor, matchers: list[GrammarMatcher | None]) -> None:
        """Sets to -inf, in place, every logit the row's matcher forbids (rows without a
        matcher, or whose matcher has terminated, are left alone: the latter's request has
        ended, and a decode step run ahead for it is discarded). Each matcher fills its row
        of a host bitmask; ``apply_bitmask`` applies the rows on the logits' device."""
        rows = [i for i, m in enumerate(matchers) if m is not None and not m.is_terminated()]
        if not rows:
            return
        bitmask = self.bitmask(len(matchers), logits.device)
        for row in rows:
            matchers[row].fill_bitmask(bitmask, row)
        self.apply_bitmask(logits, bitmask, rows)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    @abstractmethod
    def _compile(self, key: GrammarKey) -> Any:
        """Compiles ``key`` (runs in the pool); raises ``ValueError`` naming the problem."""

    @abstractmethod
    def new_matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of ``compiled``."""

    @abstractmethod
    def allocate_bitmask(self, rows: int, device: torch.device = HOST) -> torch.Tensor:
        """A host bitmask buffer for ``rows`` requests over ``vocab_size`` tokens, whose
        rows go to logits on ``device``."""

    @abstractmethod
    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Masks ``logits[rows]`` (N, vocab_size) by ``bitmask[rows]`` in place."""
