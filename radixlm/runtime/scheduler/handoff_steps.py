"""The ``Scheduler``'s part in prefill/decode disaggregation (``runtime/disaggregation``).

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

from radixlm.runtime.disaggregation.decode_handoff import DecodeHandoff
from radixlm.runtime.disaggregation.prefill_handoff import PrefillHandoff
from radixlm.runtime.request import Req, finish_abort
from radixlm.runtime.scheduler.prefill_adder import decode_reserve


class HandoffSteps:
    """Uses the scheduler's ``running``, ``waiting``, ``memory``, ``output_processor``,
    ``sampling_batch``, ``new_token_ratio``, ``_failed``, ``_running_reserve`` and
    ``drain``."""

    prefill_handoff: PrefillHandoff | None = None
    decode_handoff: DecodeHandoff | None = None

    def _enqueue(self, req: Req) -> None:
        """Where a request goes once it may run: the decode handoff for a paired request
        on a decode server (unless it wants no output), else the waiting queue."""
        if req.handoff == "receive" and req.sampling.max_new_tokens > 0:
            if not self.decode_handoff.add(req):
                req.finish_reason = finish_abort(
                    f"KV transfer failed: bootstrap_room {req.bootstrap_room} is already in use")
                self._failed.append(req)  # reported at the next step
        else:
            self.waiting.append(req)

    def _handoff_reqs(self) -> list[Req]:
        return [req for handoff in (self.prefill_handoff, self.decode_handoff)
                if handoff is not None for req in handoff.reqs()]

    def _handing_off(self) -> bool:
        return bool(self.prefill_handoff) or bool(self.decode_handoff)

    def _abort_handoff(self, req: Req) -> bool:
        """Frees a request a handoff holds (False if none does); a prefill half aborted
        before its handoff tells its decode half."""
        if self.prefill_handoff is not None and req.handoff == "send":
            if self.prefill_handoff.abort(req):
                return True
            self.prefill_handoff.abandon(req.bootstrap_room, "the prefill half was aborted")
        return bool(self.decode_handoff and self.decode_handoff.abort(req))

    def _release_ended_prefill(self, req: Req) -> None:
        """A request whose prefill ended: released, or held for its decode side (then it is
        reported finished later)."""
        if req.handoff == "send":
            self.prefill_handoff.hold(req)
        else:
            self.memory.release(req)

    def handoff_stats(self) -> dict:
        """KV moved to or from peer servers (empty unless disaggregated)."""
        stats: dict = {}
        for handoff in (self.prefill_handoff, self.decode_handoff):
            if handoff is not None:
                stats.update(dataclasses.asdict(handoff.stats), waiting=len(handoff.reqs()))
        return stats

    def _close_handoffs(self) -> None:
        for handoff in (self.prefill_handoff, self.decode_handoff):
            if handoff is not None:
                handoff.close()

    def _step_handoffs(self) -> list[Req]:
        """Moves KV that arrived or left; returns the requests that ended meanwhile or
        joined the running batch (to report their first token)."""
        stepped: list[Req] = []
        if self.prefill_handoff is not None:  # (also idle: decode sides' messages may come
            stepped += self.prefill_handoff.step()  # before their prefill halves)
        if self.decode_handoff:  # requests await KV
            joined, failed = self.decode_handoff.step(
                self.memory.available_tokens() - self._running_reserve(),
                lambda r: decode_reserve(r, self.new_token_ratio))
            stepped += failed
            if joined:
                self.drain()  # (the sampling rows must be the running requests')
                stepped += self._join(joined)
        return stepped

    def _join(self, joined: list[tuple[Req, int]]) -> list[Req]:
        """Appends each request's first token (stop checks, grammar and jump-forward as for
        any sampled token) and runs the requests it does not end."""
        for req, first_token in joined:
            if self.output_processor.append_tokens([req], [first_token], None):
                self.memory.release(req)
            else:  # (its sampling row is built from its outputs, jumped tokens included)
                self.running.append(req)
                self.sampling_batch.add([req])
        return [req for req, _ in joined]
