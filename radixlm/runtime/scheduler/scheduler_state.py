"""The state the scheduler's components share between steps (``scheduler.py`` composes them).

Every component (admission, overlap, hand-offs, beam searches, the step batches) gets this
one object at construction, with the parts of the runtime it uses (the memory, the runner,
the sampling step, and the few other components it calls: admission the hand-offs, the
hand-offs the overlap's ``drain``); what the components share between steps is here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixlm.runtime.request import Req
from radixlm.runtime.sampling.sampling_batch import SamplingBatch
from radixlm.runtime.scheduler.beam_groups import BeamGroup
from radixlm.runtime.scheduler.decode_worker import DecodeInFlight
from radixlm.runtime.scheduler.prefill_adder import decode_reserve
from radixlm.runtime.scheduler.request_memory import RequestMemory
from radixlm.runtime.scheduler.scheduler_info import SchedulerStats


@dataclass
class SchedulerState:
    """The queues, the running batch and what a step reports.

    Invariants between steps: ``running`` requests have computed their whole prompt and
    hold a row and the KV of all but their last token (all but their last jumped tokens
    and the sampled one before them, after a jump-forward); the ``chunked`` request (if
    any) holds a row and the KV of its first ``kv_len`` prompt tokens; waiting, finished
    and grammar-queued requests hold neither. ``sampling_batch`` holds a row for each
    ``running`` request, in the same order (the sampling step adds a request's row when
    it first samples it; finishing, aborting and retracting remove it).

    While a decode step is in flight (``in_flight``), its requests hold the KV of all their
    tokens and the slot of the one it computes, the host has not yet appended its tokens,
    and ``sampling_batch`` is the worker's (its rows: the step's requests); the overlap's
    ``drain`` ends that state.
    """

    sampling_batch: SamplingBatch
    new_token_ratio: float
    """KV reserved per remaining output token of a running request (``prefill_adder``):
    decays each decode step, back to 1 after a retraction."""
    waiting: list[Req] = field(default_factory=list)
    running: list[Req] = field(default_factory=list)
    chunked: Req | None = None
    """The request whose prompt is being prefilled a chunk at a time."""
    beam_groups: list[BeamGroup] = field(default_factory=list)
    """Beam searches past their prompt: all their members are in ``running``."""
    in_flight: DecodeInFlight | None = None
    to_report: list[Req] = field(default_factory=list)
    """Requests that ended or stepped outside a step (a grammar that failed, a room in use,
    a drained decode step), reported with the next step's."""
    decode_owed: bool = False
    """A chunk of a long prompt ran last step: the running requests decode before the next
    one (a long prefill delays them by one chunk at a time, not by all of it)."""
    chunk_yielded: bool = False
    """The last admission ran short prompts instead of the chunked prompt's chunk."""
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    peak_kv_tokens: int = 0
    """The most KV slots in use at once (cached ones included) since the start or the last
    ``flush_cache``."""

    def running_reserve(self) -> int:
        """KV slots the running requests hold back: their expected output, plus the jumped
        tokens (jump-forward) that have no KV yet."""
        ratio = self.new_token_ratio
        return sum(decode_reserve(r, ratio) + r.seq_len - r.kv_len - 1 for r in self.running)

    def decay_new_token_ratio(self, decay: float, floor: float) -> None:
        """One decode step went by without a retraction."""
        self.new_token_ratio = max(self.new_token_ratio - decay, floor)

    def note_kv_peak(self, memory: RequestMemory) -> None:
        used = memory.allocator.size - memory.allocator.available_size()
        self.peak_kv_tokens = max(self.peak_kv_tokens, used)

    def take_reports(self) -> list[Req]:
        reports, self.to_report = self.to_report, []
        return reports
