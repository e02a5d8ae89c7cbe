"""The prefill server's side of a disaggregated request: after its prompt is computed and
its first token sampled, the request keeps its KV until the decode server that serves the
rest asks for it (``KVWanted``), sends it, and ends only once the decode side confirms
receipt (``KVReceived``): the prefill server's answer means the KV arrived.

Either half may come first: a ``KVWanted`` for a room whose prefill is still running is
kept until it is held here. Whatever waits longer than ``timeout`` fails and frees its KV
(the router retries a failed prefill under a new room, leaving the old one orphaned).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from radixlm.runtime.disaggregation import transfer_messages as wire
from radixlm.runtime.disaggregation.bootstrap import BootstrapServer
from radixlm.runtime.disaggregation.kv_rows import KVLayout
from radixlm.runtime.disaggregation.transfer_backend import PrefillLink
from radixlm.runtime.request import Req, finish_abort
from radixlm.runtime.scheduler.request_memory import RequestMemory

logger = logging.getLogger(__name__)


@dataclass
class HeldPrefill:
    req: Req
    finish_reason: dict
    """How the request ended here (reported once its KV is delivered)."""
    since: float
    sent: bool = False
    """The KV has left (and been freed here); waiting for the decode side's receipt."""


@dataclass
class PrefillTransferStats:
    kv_transfers: int = 0
    kv_bytes_sent: int = 0
    kv_tokens_sent: int = 0
    kv_transfer_failures: int = 0


@dataclass
class PrefillHandoff:
    """Requests whose prompt is done, until their KV reaches the decode side.

    Invariant: a held request that has not ``sent`` holds its request row and the KV of its
    prompt (as a running request does); a ``sent`` one holds nothing.
    """

    link: PrefillLink
    memory: RequestMemory
    layout: KVLayout
    timeout: float
    bootstrap: BootstrapServer | None = None
    """This server's bootstrap service (closed with the handoff)."""
    clock: Callable[[], float] = time.monotonic
    held: dict[int, HeldPrefill] = field(default_factory=dict)
    early: dict[int, tuple[bytes, wire.KVWanted, float]] = field(default_factory=dict)
    """``KVWanted`` messages whose prefill is not held yet, by room."""
    abandoned: dict[int, tuple[str, float]] = field(default_factory=dict)
    """Rooms whose prefill half ended without KV (aborted, failed) before their decode
    half asked: (why, since), so that its ``KVWanted`` gets that answer at once."""
    cancelled: dict[int, tuple[str, float]] = field(default_factory=dict)
    """Rooms whose decode half was cancelled before their prefill half was held here:
    (why, since), so that the prefill half fails as soon as it is."""
    stats: PrefillTransferStats = field(default_factory=PrefillTransferStats)

    def hold(self, req: Req) -> list[Req]:
        """Takes a request whose prefill just ended (``finish_reason`` set, KV still held);
        returns it if it ends here at once (no output wanted: the decode side asks for
        nothing then)."""
        if not req.output_ids:
            self.memory.release(req)
            return [req]
        room = req.bootstrap_room
        if room in self.held:  # two requests under one room: the second cannot pair
            self.memory.release(req)
            req.finish_reason = finish_abort(f"KV transfer failed: bootstrap_room {room} is "
                                             "already in use")
            return [req]
        finish, req.finish_reason = req.finish_reason, None
        self.held[room] = HeldPrefill(req, finish, self.clock())
        if room in self.cancelled:
            return [self._fail(room, self.cancelled.pop(room)[0])]
        early = self.early.pop(room, None)
        if early is not None:
            return self._send(room, *early[:2])
        return []

    def reqs(self) -> list[Req]:
        return [h.req for h in self.held.values()]

    def __bool__(self) -> bool:
        return bool(self.held or self.early or self.abandoned or self.cancelled)

    def step(self) -> list[Req]:
        """Handles what decode sides sent and the deadlines; returns the requests that
        ended (delivered or failed)."""
        ended: list[Req] = []
        for peer, message in self.link.poll():
            if isinstance(message, wire.KVWanted):
                if message.room in self.abandoned:
                    why, _ = self.abandoned.pop(message.room)
                    self.link.send_header(peer, wire.KVSent(message.room, error=why))
                elif message.room in self.held and not self.held[message.room].sent:
                    ended += self._send(message.room, peer, message)
                elif message.room not in self.held:
                    self.early[message.room] = (peer, message, self.clock())
            elif isinstance(message, wire.KVReceived):
                held = self.held.get(message.room)
                if held is not None and held.sent:
                    del self.held[message.room]
                    held.req.finish_reason = (held.finish_reason if message.error is None
                                              else finish_abort(message.error))
                    ended.append(held.req)
            elif isinstance(message, wire.KVCancel):
                self.early.pop(message.room, None)
                why = message.error or "the decode server cancelled the request"
                if message.room in self.held:
                    ended.append(self._fail(message.room, why))
                else:
                    self.cancelled[message.room] = (why, self.clock())
        now = self.clock()
        for room, held in list(self.held.items()):
            if now - held.since > self.timeout:
                what = "confirmed receipt of" if held.sent else "asked for"
                ended.append(self._fail(room, f"no decode server {what} the KV of "
                                              f"bootstrap_room {room} within {self.timeout} s"))
        for waiting in (self.early, self.abandoned, self.cancelled):
            for room, entry in list(waiting.items()):
                if now - entry[-1] > self.timeout:
                    del waiting[room]
        return ended

    def abort(self, req: Req) -> bool:
        """Ends a held request (its KV freed); False if it is not held here."""
        room = req.bootstrap_room
        if room not in self.held or self.held[room].req is not req:
            return False
        held = self.held.pop(room)
        self._release(held)
        if not held.sent:
            self.abandon(room, "the prefill half was aborted")
        return True

    def abandon(self, room: int, why: str) -> None:
        """The prefill half of ``room`` ended without KV: its decode half is told ``why``
        (now if it has asked, else when it does) instead of waiting out its timeout."""
        early = self.early.pop(room, None)
        if early is not None:
            self.link.send_header(early[0], wire.KVSent(room, error=why))
        else:
            self.abandoned[room] = (why, self.clock())

    def close(self) -> None:
        self.link.close()
        if self.bootstrap is not None:
            self.bootstrap.close()

    def _send(self, room: int, peer: bytes, wanted: wire.KVWanted) -> list[Req]:
        held = self.held[room]
        req = held.req
        problem = self.layout.mismatch(wanted.layout)
        if problem is None and wanted.prompt_len != len(req.input_ids):
            problem = (f"the decode server's prompt has {wanted.prompt_len} tokens, "
                       f"this one {len(req.input_ids)}")
        if problem is None and not 0 <= wanted.start < wanted.prompt_len:
            problem = f"the decode server asked for KV from position {wanted.start}"
        if problem is not None:
            self.link.send_header(peer, wire.KVSent(room, error=problem))
            return [self._fail(room, problem)]
        slots = self.memory.req_to_token[req.req_pool_idx, wanted.start : wanted.prompt_len]
        logprobs = req.logprobs is not None
        problem = self.link.send_kv(peer, wire.KVSent(
            room, wanted.start, wanted.prompt_len, first_token=req.output_ids[0],
            cached_tokens=req.cached_tokens,
            first_token_logprob=req.output_token_logprobs[0] if logprobs else None,
            first_top_logprobs=(req.output_top_logprobs[0] if logprobs and
                                req.output_top_logprobs else None),
        ), wanted, slots)
        if problem is not None:
            return [self._fail(room, problem)]
        count = wanted.prompt_len - wanted.start
        self.stats.kv_transfers += 1
        self.stats.kv_tokens_sent += count
        self.stats.kv_bytes_sent += count * self.layout.bytes_per_token()
        self.memory.release(req)  # into this server's prefix cache
        held.sent, held.since = True, self.clock()
        return []

    def _fail(self, room: int, message: str) -> Req:
        held = self.held.pop(room)
        self._release(held)
        held.req.finish_reason = finish_abort(f"KV transfer failed: {message}")
        self.stats.kv_transfer_failures += 1
        logger.warning("KV transfer failed: request %s, bootstrap_room %d (to its decode "
                       "server): %s", held.req.rid, room, message)
        return held.req

    def _release(self, held: HeldPrefill) -> None:
        if not held.sent:
            self.memory.release(held.req)
