"""FlashInfer's paged-KV page table for one batch, built without reading the device.

FlashInfer takes a batch's KV as a CSR table over pages: ``indptr`` (B+1,), ``indices``
(the pages, request after request) and ``last_page_len`` (B,); an extend plan adds the
queries' ``qo_indptr`` (B+1,). Its ``plan`` computes the kernel schedule from ``indptr``,
``last_page_len`` and ``qo_indptr`` on the host and copies them to the device itself, so
those three are built here on the host, from the lengths the scheduler already keeps there
(``ForwardBatch.seq_lens_list`` / ``extend_seq_lens_list``). Handing ``plan`` device arrays
instead makes it copy them back, a wait on the device every step.

``indices`` depends on ``req_to_token``, which lives on the device, so it is built there,
by device ops whose output sizes the host already knows (the page count); nothing is read
back.

The host arrays go into ``PlanStaging``: pinned memory in two halves, one per batch in
turn, so that ``plan``'s asynchronous copies out of one batch's arrays are never
overwritten by the next batch's. A half is refilled two batches later, after an event
recorded behind its copies. The backend plans a batch before its first kernel, so those
copies run when the batch before it ends; under overlap the host has waited for that
batch's tokens before it builds the batch that refills the half, so the event is done.

Page layout (the allocator's invariant): token i of a request lives at offset
``i % page_size`` of its page, so its pages are ``req_to_token[row, 0:n:page_size] //
page_size`` and its last page holds ``(n - 1) % page_size + 1`` tokens. ``window``: pages
wholly before the first key the first new token sees are left out; ``slot_map``: the
pages are the layer's own (``slot_map[first slot of the page] // page_size``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from radixlm.kernels.forward_batch import ForwardBatch, ForwardMode


@dataclass(frozen=True)
class HostPageTable:
    """The host half of a plan's page table: int32 CPU tensors (pinned on CUDA)."""

    indptr: torch.Tensor
    """(B+1,) where each request's pages start in ``indices``."""
    last_page_len: torch.Tensor
    """(B,) tokens in each request's last page, 1..page_size."""
    qo_indptr: torch.Tensor
    """(B+1,) where each request's new tokens start in the batch's queries."""
    total_pages: int


def first_pages(seq_lens: list[int], new_lens: list[int], page_size: int,
                window: int | None) -> list[int]:
    """Each request's first listed page: 0, or under a window of W keys the page of the
    first key its first new token sees (key ``n - new + 1 - W``)."""
    if window is None:
        return [0] * len(seq_lens)
    return [max(n - new + 1 - window, 0) // page_size for n, new in zip(seq_lens, new_lens)]


class PlanStaging:
    """Pinned host memory for plans' index arrays, in two halves used a batch at a time.

    ``start_batch`` switches halves; ``put`` copies a list into the current half and
    returns the slice; ``plan_done`` records (on CUDA) that the copies made so far out of
    this half are queued, so the half is not refilled before they run.
    """

    def __init__(self, device: torch.device, capacity: int = 4096):
        self._cuda = device.type == "cuda"
        self._halves = [self._alloc(capacity), self._alloc(capacity)]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._half = 0
        self._used = 0

    def _alloc(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.int32, pin_memory=self._cuda)

    def start_batch(self) -> None:
        self._half ^= 1
        self._used = 0
        event = self._events[self._half]
        if event is not None:
            event.synchronize()  # the copies of two batches ago: done under overlap

    def put(self, values: list[int]) -> torch.Tensor:
        n = len(values)
        half = self._halves[self._half]
        if self._used + n > len(half):
            # The old block stays with PyTorch's pinned allocator until its copies finish.
            half = self._halves[self._half] = self._alloc(max(2 * len(half), n))
            self._used = 0
        out = half[self._used: self._used + n]
        out.copy_(torch.tensor(values, dtype=torch.int32))
        self._used += n
        return out

    def plan_done(self) -> None:
        if self._cuda:
            event = torch.cuda.Event()
            event.record()
            self._events[self._half] = event


def host_page_table(fb: ForwardBatch, page_size: int, window: int | None = None,
                    staging: PlanStaging | None = None) -> HostPageTable:
    """``indptr``, ``last_page_len`` and ``qo_indptr`` from the batch's host lengths, in
    ``staging`` when given (else fresh CPU tensors)."""
    seq_lens = fb.seq_lens_list
    new_lens = (fb.extend_seq_lens_list if fb.mode is ForwardMode.EXTEND
                else [1] * len(seq_lens))
    first = first_pages(seq_lens, new_lens, page_size, window)
    pages = [-(-n // page_size) - f for n, f in zip(seq_lens, first)]
    indptr = list(itertools.accumulate(pages, initial=0))
    last = [(n - 1) % page_size + 1 for n in seq_lens]
    qo_indptr = list(itertools.accumulate(new_lens, initial=0))

    def host(values: list[int]) -> torch.Tensor:
        if staging is None:
            return torch.tensor(values, dtype=torch.int32)
        return staging.put(values)

    return HostPageTable(host(indptr), host(last), host(qo_indptr), indptr[-1])


def device_page_indices(fb: ForwardBatch, page_size: int, total_pages: int,
                        window: int | None = None,
                        slot_map: torch.Tensor | None = None) -> torch.Tensor:
    """The page list (total_pages,) int32 on the batch's device; ``total_pages`` must be
    the host table's."""
    seq_lens, rows = fb.seq_lens, fb.req_pool_indices  # (B,)
    device = seq_lens.device
    if slot_map is not None and slot_map.device != device:
        raise ValueError(f"the slot map is on {slot_map.device}, the batch on {device}")
    end_page = (seq_lens + page_size - 1) // page_size  # (B,)
    first_page = torch.zeros_like(end_page)
    if window is not None:
        new = fb.extend_seq_lens if fb.mode is ForwardMode.EXTEND else 1
        first_page = (seq_lens - new + 1 - window).clamp(min=0) // page_size
    pages_per_req = end_page - first_page
    starts = torch.cumsum(pages_per_req, 0) - pages_per_req  # (B,)
    # The output size is the host's, so the device is not asked for it.
    req = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), pages_per_req,
                                  output_size=total_pages)  # (P,)
    page = first_page[req] + torch.arange(total_pages, device=device) - starts[req]
    first_slot = (page * page_size).clamp(max=fb.req_to_token.shape[1] - 1)
    slots = fb.req_to_token[rows[req], first_slot]  # (P,)
    if slot_map is not None:
        slots = slot_map[slots]
    return (slots // page_size).to(torch.int32)
