"""The scheduler's part in prefill/decode disaggregation (``runtime/disaggregation``).

On a prefill server, a request paired with a decode server (``Req.handoff == "send"``)
ends after its first token, as if its budget were one token; instead of being released it
goes to the ``PrefillHandoff`` with its KV, which reports it finished once the decode side
has the KV. A ``"fake"`` one (the router's warm-up pairs) just ends there.

On a decode server, a paired request (``"receive"``) skips admission: the
``DecodeHandoff`` gives it slots and fills them with the prefill server's KV, and it joins
the running batch with the prefill server's first token as its last, KV-less, token (a
running request's usual state). From there it is an ordinary request: it decodes,
streams, and, if retracted, recomputes its prompt on this server.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from radixlm.runtime.disaggregation.decode_handoff import AdapterRoom, DecodeHandoff
from radixlm.runtime.disaggregation.prefill_handoff import PrefillHandoff
from radixlm.runtime.request import Req, finish_abort
from radixlm.runtime.scheduler.prefill_adder import decode_reserve
from radixlm.runtime.scheduler.request_memory import RequestMemory
from radixlm.runtime.scheduler.sampling_step import SamplingStep
from radixlm.runtime.scheduler.scheduler_state import SchedulerState


class Handoffs:
    """The prefill server's and the decode server's hand-offs (either, or neither on a
    server that does both halves)."""

    def __init__(self, state: SchedulerState, memory: RequestMemory,
                 sampling_step: SamplingStep, drain: Callable[[], None],
                 prefill: PrefillHandoff | None = None, decode: DecodeHandoff | None = None,
                 max_adapters: int | None = None):
        """``drain``: ends the decode step in flight (before requests join ``running``);
        ``max_adapters``: the LoRA adapters a batch may hold (None: none served)."""
        self.state = state
        self.max_adapters = max_adapters
        self.memory = memory
        self.sampling_step = sampling_step
        self.drain = drain
        self.prefill, self.decode = prefill, decode

    def receive(self, req: Req) -> bool:
        """Hands a paired request on a decode server to the decode hand-off, to wait for
        its KV; False (``req`` finished) if its room is in use."""
        if self.decode.add(req):
            return True
        req.finish_reason = finish_abort(
            f"KV transfer failed: bootstrap_room {req.bootstrap_room} is already in use")
        return False

    def reqs(self) -> list[Req]:
        return [req for handoff in (self.prefill, self.decode)
                if handoff is not None for req in handoff.reqs()]

    def busy(self) -> bool:
        """Whether either hand-off holds a request."""
        return bool(self.prefill) or bool(self.decode)

    def abort(self, req: Req) -> bool:
        """Frees a request a hand-off holds (False if none does); a prefill half aborted
        before its hand-off tells its decode half."""
        if self.prefill is not None and req.handoff == "send":
            if self.prefill.abort(req):
                return True
            self.prefill.abandon(req.bootstrap_room, "the prefill half was aborted")
        return bool(self.decode and self.decode.abort(req))

    def release_ended_prefill(self, req: Req) -> None:
        """A request whose prefill ended: released, or held for its decode side (then it is
        reported finished later)."""
        if req.handoff == "send":
            self.prefill.hold(req)
        else:
            self.memory.release(req)

    def stats(self) -> dict:
        """KV moved to or from peer servers (empty unless disaggregated)."""
        stats: dict = {}
        for handoff in (self.prefill, self.decode):
            if handoff is not None:
                stats.update(dataclasses.asdict(handoff.stats), waiting=len(handoff.reqs()))
        return stats

    def close(self) -> None:
        for handoff in (self.prefill, self.decode):
            if handoff is not None:
                handoff.close()

    def step(self) -> list[Req]:
        """Moves KV that arrived or left; returns the requests that ended meanwhile or
        joined the running batch (to report their first token)."""
        stepped: list[Req] = []
        if self.prefill is not None:  # (also idle: decode sides' messages may come
            stepped += self.prefill.step()  # before their prefill halves)
        if self.decode:  # requests await KV
            ratio = self.state.new_token_ratio
            room = None if self.max_adapters is None else AdapterRoom(
                {r.lora_name for r in self.state.running if r.lora_name}, self.max_adapters)
            joined, failed = self.decode.step(
                self.memory.available_tokens() - self.state.running_reserve(),
                lambda r: decode_reserve(r, ratio), room)
            stepped += failed
            if joined:
                self.drain()  # (the sampling rows must be the running requests')
                stepped += self._join(joined)
        return stepped

    def _join(self, joined: list[tuple[Req, int]]) -> list[Req]:
        """Appends each request's first token (stop checks, grammar and jump-forward as for
        any sampled token) and runs the requests it does not end."""
        for req, first_token in joined:
            if self.sampling_step.append_tokens([req], [first_token], None):
                self.memory.release(req)
            else:  # (its sampling row is built from its outputs, jumped tokens included)
                self.state.running.append(req)
                self.state.sampling_batch.add([req])
        return [req for req, _ in joined]
