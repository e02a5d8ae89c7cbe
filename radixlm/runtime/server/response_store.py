"""Finished responses kept in memory, so that a request may continue one
(``previous_response_id``) and a client may read or delete one (``GET`` / ``DELETE
/v1/responses/{id}``).

What is kept: for each response stored (a request with ``store`` true, the default), the
response object as it was answered (its output among it), the request's own input items
(as the request's JSON) and the id of the response it continued. A continuation's
conversation is rebuilt by walking that chain back (``conversation``), so each entry holds
and counts only its own turn: a chain of n turns costs characters linear in n. Nothing is
written to disk; a restart forgets everything.

How long: an entry is dropped when

- it was not read or written for ``idle_seconds`` (default an hour), or
- storing another one would exceed ``max_responses`` entries or ``max_chars`` characters
  (of the entries' JSON, all together): the least recently used go first, or
- it is deleted.

Rebuilding a conversation uses every link of its chain, so a chain in use ages as one; a
chain whose link was dropped cannot be continued past it (``conversation`` is None).

Invariants: ``chars`` is the sum of the stored entries' sizes and never exceeds
``max_chars``; there are at most ``max_responses`` entries; the queue's order is the order
of last use, so the entries that expire first are at its front. An entry larger than
``max_chars`` alone is not stored (``put`` returns False, and the caller answers the
response as not stored). The store is used from the server's event loop only; it takes
no locks.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    """A response as answered (its JSON object), the input items of its own request
    (request JSON, in order) and the id of the response it continued (None for a first
    turn)."""

    response: dict[str, Any]
    input: list[dict[str, Any]]
    previous_id: str | None = None

    @property
    def chars(self) -> int:
        return len(json.dumps(self.response)) + len(json.dumps(self.input))


@dataclass
class _Entry:
    stored: StoredResponse
    chars: int
    last_used: float


class ResponseStore:
    """An LRU map of response ids to ``StoredResponse``s, bounded by count, characters and
    idle time (module docstring)."""

    def __init__(self, max_responses: int = 1024, max_chars: int = 64 * 2**20,
                 idle_seconds: float = 3600.0, clock: Callable[[], float] = time.monotonic):
        if max_responses < 1:
            raise ValueError(f"max_responses must be at least 1, got {max_responses}")
        if max_chars < 1:
            raise ValueError(f"max_chars must be at least 1, got {max_chars}")
        if idle_seconds <= 0:
            raise ValueError(f"idle_seconds must be positive, got {idle_seconds}")
        self.max_responses, self.max_chars, self.idle_seconds = (max_responses, max_chars,
                                                                 idle_seconds)
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.chars = 0

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def __contains__(self, response_id: str) -> bool:
        self._expire()
        return response_id in self._entries

    def put(self, response_id: str, stored: StoredResponse) -> bool:
        """Stores (or replaces) ``response_id``, dropping the least recently used entries
        until it fits; False (and nothing stored or dropped) where it alone is too large."""
        self._expire()
        size = stored.chars
        if size > self.max_chars:
            return False
        self.delete(response_id)
        while self._entries and (len(self._entries) >= self.max_responses
                                 or self.chars + size > self.max_chars):
            self._drop(next(iter(self._entries)))
        self._entries[response_id] = _Entry(stored, size, self._clock())
        self.chars += size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry (now the most recently used), or None where it is unknown or gone."""
        self._expire()
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        entry.last_used = self._clock()
        self._entries.move_to_end(response_id)
        return entry.stored

    def conversation(self, response_id: str) -> list[dict[str, Any]] | None:
        """Every item that led to ``response_id`` and its output, oldest first: each link's
        input then its response's output, walking back through ``previous_id``. None where
        the response or any link before it is unknown or gone."""
        turns: list[StoredResponse] = []
        seen: set[str] = set()
        link: str | None = response_id
        while link is not None:
            stored = self.get(link) if link not in seen else None
            if stored is None:
                return None
            seen.add(link)
            turns.append(stored)
            link = stored.previous_id
        return [item for stored in reversed(turns)
                for item in (*stored.input, *stored.response["output"])]

    def delete(self, response_id: str) -> bool:
        """Drops the entry; False where there was none (or it had expired)."""
        self._expire()
        if response_id not in self._entries:
            return False
        self._drop(response_id)
        return True

    def _drop(self, response_id: str) -> None:
        self.chars -= self._entries.pop(response_id).chars

    def _expire(self) -> None:
        """Drops the entries idle for ``idle_seconds``: a prefix of the queue."""
        deadline = self._clock() - self.idle_seconds
        while self._entries:
            oldest = next(iter(self._entries))
            if self._entries[oldest].last_used > deadline:
                return
            self._drop(oldest)
