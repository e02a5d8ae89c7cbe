"""The decode server's side of a disaggregated request: find the prefill server
(``bootstrap``), take slots for the prompt's KV, ask for it, write it into the pool when it
comes, and hand the request to the scheduler's running batch with its first token (sampled
by the prefill server) as its last token.

States of an ``AwaitedKV``: looking up the prefill server -> waiting for memory (a request
row and the prompt's slots, less what this server's own prefix cache holds: that part is
locked, not fetched) -> asked (``KVWanted`` sent) -> joined (or failed). A request that
waits longer than ``timeout`` in total fails and frees what it holds; the prefill side is
told (``KVCancel``) once it has been asked. A request on a LoRA adapter waits for memory
also while the adapters of the running batch and of the asked requests leave it no slot
(``AdapterRoom``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from radixlm.runtime.disaggregation import transfer_messages as wire
from radixlm.runtime.disaggregation.bootstrap import BootstrapDirectory, PrefillPeer
from radixlm.runtime.disaggregation.kv_rows import KVLayout
from radixlm.runtime.disaggregation.transfer_backend import DecodeLink
from radixlm.runtime.request import Req, finish_abort
from radixlm.runtime.scheduler.request_memory import RequestMemory

logger = logging.getLogger(__name__)

LOOKING_UP, NEEDS_MEMORY, ASKED = "looking up", "needs memory", "asked"


@dataclass
class AwaitedKV:
    req: Req
    since: float
    state: str = LOOKING_UP
    peer: PrefillPeer | None = None


@dataclass
class DecodeTransferStats:
    kv_transfers: int = 0
    kv_bytes_received: int = 0
    kv_tokens_received: int = 0
    decode_cached_tokens: int = 0
    """Prompt tokens this decode server's own prefix cache held (not fetched)."""
    kv_transfer_failures: int = 0


@dataclass
class AdapterRoom:
    """The LoRA adapters a step's batch may hold: ``present`` (the running requests' and
    the asked ones') and at most ``limit`` (``max_loras_per_batch``). In arrival order, a
    request on a present adapter may go; one on another takes a free place, and once one
    finds none, no request on an absent adapter goes before it does (none starves)."""

    present: set[str]
    limit: int
    blocked: bool = False

    def admits(self, req: Req) -> bool:
        name = req.lora_name
        if name is None or name in self.present:
            return True
        if self.blocked or len(self.present) >= self.limit:
            self.blocked = True
            return False
        self.present.add(name)
        return True


@dataclass
class DecodeHandoff:
    """Requests waiting for their prompt's KV from a prefill server.

    Invariant: an ``ASKED`` request holds a request row and slots for its whole prompt
    (``kv_len`` = prompt length; the first ``len(prefix_indices)`` locked in the prefix
    cache); the others hold nothing.
    """

    link: DecodeLink
    memory: RequestMemory
    layout: KVLayout
    timeout: float
    directory: BootstrapDirectory = field(default_factory=BootstrapDirectory)
    clock: Callable[[], float] = time.monotonic
    awaited: dict[int, AwaitedKV] = field(default_factory=dict)
    stats: DecodeTransferStats = field(default_factory=DecodeTransferStats)

    def add(self, req: Req) -> bool:
        """Awaits ``req``'s KV; False (and nothing kept) if its room is awaited already."""
        if req.bootstrap_room in self.awaited:
            return False
        self.awaited[req.bootstrap_room] = AwaitedKV(req, self.clock())
        return True

    def __bool__(self) -> bool:
        return bool(self.awaited)

    def reqs(self) -> list[Req]:
        return [a.req for a in self.awaited.values()]

    def step(self, spare_tokens: int, reserve: Callable[[Req], int],
             adapter_room: AdapterRoom | None = None
             ) -> tuple[list[tuple[Req, int]], list[Req]]:
        """Advances every awaited request; returns (requests whose KV arrived, now holding
        it, each with its first token (sampled by the prefill server, no KV yet): the
        scheduler's to run; requests that failed, finished).

        ``spare_tokens``: KV slots the running requests can spare; ``reserve(req)``: what
        one more running request needs beyond its prompt; ``adapter_room``: the running
        batch's LoRA adapters and their limit (None: no adapters served)."""
        failed: list[Req] = []
        if adapter_room is not None:
            adapter_room.present.update(a.req.lora_name for a in self.awaited.values()
                                        if a.state == ASKED and a.req.lora_name)
        for room, awaited in list(self.awaited.items()):
            if awaited.state == LOOKING_UP:
                peer = self.directory.peer(awaited.req.bootstrap_address)
                if isinstance(peer, str):
                    failed.append(self._fail(room, peer))
                elif peer is not None:
                    problem = peer.layout.mismatch(self.layout)
                    if problem is not None:
                        self.link.send(peer.endpoint, wire.KVCancel(room, problem))
                        failed.append(self._fail(room, problem))
                    else:
                        awaited.peer, awaited.state = peer, NEEDS_MEMORY
            if awaited.state == NEEDS_MEMORY and (adapter_room is None
                                                  or adapter_room.admits(awaited.req)):
                spare_tokens -= self._ask(awaited, spare_tokens, reserve)
        joined = []
        for header, frames in self.link.poll():
            awaited = self.awaited.get(header.room)
            if awaited is None or awaited.state != ASKED:
                continue  # a room that failed here already (its KV comes late)
            error = header.error or self._write(awaited.req, header, frames)
            self.link.send(awaited.peer.endpoint, wire.KVReceived(header.room, error))
            if error is not None:
                failed.append(self._fail(header.room, error))
            else:
                del self.awaited[header.room]
                self._join(awaited.req, header)
                joined.append((awaited.req, header.first_token))
        now = self.clock()
        for room, awaited in list(self.awaited.items()):
            if now - awaited.since > self.timeout:
                address = awaited.req.bootstrap_address
                failed.append(self._fail(room, f"no KV came from the prefill server at "
                                               f"{address} within {self.timeout} s "
                                               f"({awaited.state})"))
        return joined, failed

    def abort(self, req: Req) -> bool:
        """Ends an awaited request (what it holds freed, the prefill side told); False if
        it is not awaited here."""
        awaited = self.awaited.get(req.bootstrap_room)
        if awaited is None or awaited.req is not req:
            return False
        self._drop(req.bootstrap_room)
        return True

    def close(self) -> None:
        self.directory.close()
        self.link.close()

    def _ask(self, awaited: AwaitedKV, spare_tokens: int, reserve: Callable[[Req], int]
             ) -> int:
        """Takes a row and the prompt's slots and sends ``KVWanted``, if memory allows;
        returns the slots taken."""
        req, memory = awaited.req, self.memory
        prompt_len = len(req.input_ids)
        if not memory.req_to_token_pool.available_size():
            return 0
        memory.match_and_lock(req)
        start = len(req.prefix_indices)
        need = prompt_len - start
        if need + reserve(req) > min(spare_tokens, memory.available_tokens()):
            memory.unlock(req)
            return 0
        memory.assign_row(req)
        memory.alloc(req, need)
        req.kv_len = prompt_len
        awaited.state = ASKED
        slots = memory.req_to_token[req.req_pool_idx, start:prompt_len]
        self.link.send(awaited.peer.endpoint, wire.KVWanted(
            req.bootstrap_room, prompt_len, start, self.layout, self.link.target(slots)))
        return need

    def _write(self, req: Req, header: wire.KVSent, frames: list) -> str | None:
        """Writes the KV of ``header`` into ``req``'s slots; an error message if it does
        not fit them."""
        start = len(req.prefix_indices)
        if (header.start, header.prompt_len) != (start, len(req.input_ids)):
            return (f"the prefill server sent positions {header.start}..{header.prompt_len}"
                    f" for {start}..{len(req.input_ids)}")
        slots = self.memory.req_to_token[req.req_pool_idx, start : len(req.input_ids)]
        problem = self.link.receive(header, frames, slots)
        if problem is not None:
            return problem
        count = len(req.input_ids) - start
        self.stats.kv_transfers += 1
        self.stats.kv_tokens_received += count
        self.stats.kv_bytes_received += count * self.layout.bytes_per_token()
        self.stats.decode_cached_tokens += start
        return None

    def _join(self, req: Req, header: wire.KVSent) -> None:
        """``req`` now holds its prompt's KV: the prefill server's first token (and its
        logprobs) becomes its first output; its prompt enters this server's prefix cache."""
        req.cached_tokens = header.cached_tokens
        if req.logprobs is not None and header.first_token_logprob is not None:
            req.output_token_logprobs.append(header.first_token_logprob)
            if header.first_top_logprobs is not None:
                req.output_top_logprobs.append(header.first_top_logprobs)
        self.memory.cache_unfinished(req)

    def _fail(self, room: int, message: str) -> Req:
        address = self.awaited[room].req.bootstrap_address
        req = self._drop(room)
        self.directory.forget(address)  # the prefill server may have moved
        req.finish_reason = finish_abort(f"KV transfer failed: {message}")
        self.stats.kv_transfer_failures += 1
        logger.warning("KV transfer failed: request %s, bootstrap_room %d, prefill server %s: "
                       "%s", req.rid, room, address, message)
        return req

    def _drop(self, room: int) -> Req:
        """Forgets ``room``: frees what its request holds (never caching it: its KV may not
        have arrived), and tells the prefill side, if it knows where that is."""
        awaited = self.awaited.pop(room)
        if awaited.state == ASKED:
            self.memory.discard(awaited.req)
        if awaited.peer is not None:
            self.link.send(awaited.peer.endpoint, wire.KVCancel(room))
        return awaited.req
