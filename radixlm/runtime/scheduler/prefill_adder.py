"""One admission round: which requests to prefill this step, and how many tokens of each.

Budgets:
- KV slots: what can be had now (free + evictable) minus ``reserved``: the running
  requests' expected decoding plus what this round has already taken. A new request must
  fit its whole remaining prompt plus its own expected decoding, so that once admitted it
  can always finish its prefill.
- ``prefill_tokens``: new tokens computed this step (``max_prefill_tokens``). The round's
  first request always makes progress, so a long prompt is never starved.
- ``chunk_tokens``: a prompt longer than ``chunked_prefill_size`` is cut into page-aligned
  chunks; its first chunk runs now and it continues as the scheduler's chunked request in
  later steps. At most one request is chunked at a time, and it ends the round. Without
  chunking, a prompt is prefilled whole or not at all.
- ``yield_budget``: while a prompt is being prefilled chunk by chunk, its rounds first
  admit waiting prompts that fit whole in this budget (half a chunk, at most half of
  ``prefill_tokens``), so a short request waits for one chunk step, not the whole long
  prefill (its KV is kept for the chunk while the short ones are admitted; the scheduler
  runs them alone and the chunk in the next step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixlm.kv_cache.allocator import pages_for
from radixlm.kv_cache.base import MatchResult
from radixlm.runtime.request import Req
from radixlm.runtime.scheduler.request_memory import RequestMemory

CLIP_MAX_NEW_TOKENS = 4096
"""Output budgets above this are reserved as if they were this (long budgets are rarely used)."""


def decode_reserve(req: Req, new_token_ratio: float) -> int:
    """KV slots to hold back for the tokens ``req`` is expected to still produce."""
    remaining = max(req.sampling.max_new_tokens - len(req.output_ids), 0)
    return int(min(remaining, CLIP_MAX_NEW_TOKENS) * new_token_ratio)


@dataclass
class PrefillAdder:
    memory: RequestMemory
    reserved: int
    prefill_tokens: int
    chunk_tokens: int | None
    rows: int
    new_token_ratio: float
    reqs: list[Req] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    new_reqs: list[Req] = field(default_factory=list)
    chunked_req: Req | None = None
    """The request left partly prefilled by this round, if any."""
    adapters: set[str] = field(default_factory=set)
    """The LoRA adapters of the running requests and of those admitted so far."""
    max_adapters: int | None = None
    """Most distinct adapters the running batch may hold (None: no adapters served); a
    request whose adapter would go past it ends the round, so it waits at the head of the
    queue and no adapter starves behind others that keep arriving."""
    yield_budget: int | None = None
    """While set, only prompts whose remaining tokens fit it whole are admitted (each
    takes its share); see the module."""

    def add_short_before_chunk(self, chunked: Req, waiting) -> None:
        """Admits, from ``waiting`` ((request, match) pairs in policy order), the prompts
        that fit whole in half a chunk (and half the step's budget), keeping KV for
        ``chunked``'s next chunk."""
        if self.chunk_tokens is None:
            return
        next_chunk = self._pages(min(chunked.seq_len - chunked.kv_len, self.chunk_tokens))
        self.reserved += next_chunk
        self.yield_budget = min(self.chunk_tokens, self.prefill_tokens) // 2
        for req, match in waiting:
            if not self.add_new(req, match):
                break
        self.yield_budget = None
        self.reserved -= next_chunk

    def add_chunked(self, req: Req) -> bool:
        """Continues the request being prefilled chunk by chunk; False if it must wait."""
        remaining = req.seq_len - req.kv_len
        size = self._size(remaining)
        if size == 0 or self._pages(size) > self._available():
            return False
        self._take(req, size, remaining)
        return True

    def add_new(self, req: Req, match: MatchResult | None = None) -> bool:
        """Admits ``req`` if it fits; False ends the round. ``match``: its cached prefix,
        if the policy already matched it this round (else it is matched here)."""
        if self.chunked_req is not None or self.rows < req.width:
            return False
        if (self.max_adapters is not None and req.lora_name
                and req.lora_name not in self.adapters
                and len(self.adapters) >= self.max_adapters):
            return False
        memory = self.memory
        memory.match_and_lock(req, match)
        remaining = req.seq_len - len(req.prefix_indices)
        size = self._size(remaining)
        if self.yield_budget is not None and (remaining > self.yield_budget or size < remaining):
            size = 0  # beside a chunked prompt, only whole short ones
        reserve = decode_reserve(req, self.new_token_ratio)
        if req.beam is not None:  # each beam decodes, and may copy a page when it forks
            reserve = req.width * (reserve + self.memory.page_size)
        if size == 0 or self._pages(remaining) + reserve > self._available():
            memory.unlock(req)
            return False
        if self.yield_budget is not None:
            self.yield_budget -= remaining
        memory.assign_row(req)
        if req.lora_name:
            self.adapters.add(req.lora_name)
        self.rows -= req.width
        self.new_reqs.append(req)
        self._take(req, size, remaining)
        self.reserved += reserve
        return True

    def _available(self) -> int:
        return self.memory.available_tokens() - self.reserved

    def _size(self, remaining: int) -> int:
        """Tokens to prefill now out of ``remaining`` (0: not this round)."""
        size = remaining if self.chunk_tokens is None else min(remaining, self.chunk_tokens)
        if self.reqs:
            size = min(size, self.prefill_tokens)
        if size < remaining:
            if self.chunk_tokens is None:
                return 0
            page = self.memory.page_size
            size -= size % page
            if size == 0 and not self.reqs:
                size = min(page, remaining)
        return size

    def _take(self, req: Req, size: int, remaining: int) -> None:
        self.reqs.append(req)
        self.extend_lens.append(size)
        self.prefill_tokens -= size
        self.reserved += self._pages(size)
        if size < remaining:
            self.chunked_req = req

    def _pages(self, num_tokens: int) -> int:
        return pages_for(num_tokens, self.memory.page_size)
