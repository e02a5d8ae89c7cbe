"""The decode worker: a thread that runs decode steps' forward passes and sampling in
order, one step ahead of the host (the overlap scheduling of ``overlap.py``), and the
``DecodeInFlight`` handle of a step queued on it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from radixlm.host_to_device import to_device
from radixlm.kernels.forward_batch import ForwardBatch
from radixlm.runtime.model_executor.device_setup import make_device_current
from radixlm.runtime.request import Req
from radixlm.runtime.sampling.logprobs import LogprobCopy, Logprobs
from radixlm.runtime.sampling.sampler import Sampler
from radixlm.runtime.sampling.sampling_batch import GRAMMAR, SamplingBatch


@dataclass
class DecodeInFlight:
    """A decode step queued on or running on the worker."""

    reqs: list[Req]
    """Its requests, in the sampling batch's row order when it samples."""
    logprob_rows: list[int] = field(default_factory=list)
    """The rows of the requests that want their tokens' logprobs."""
    host_ready: threading.Event = field(default_factory=threading.Event)
    """Set once the host has processed the step before (its matchers have accepted that
    step's tokens): a step with grammars samples only then."""
    jumped: list[Req] = field(default_factory=list)
    """Requests that jump-forward extended after this step was queued: its tokens for them
    are discarded, and no step is queued behind it."""
    tokens: Future = field(default_factory=Future)
    """Resolves to the sampled tokens, (len(reqs),) int64 on the device, a function
    returning them as a list (see ``_start_copy_to_host``) and the ``LogprobCopy`` of
    ``logprob_rows`` (None without any)."""

    def host_outputs(self) -> tuple[list[int], Logprobs | None]:
        """Waits for this step's tokens (only: not for steps queued after it), then reads
        its logprobs, copied behind them."""
        _, read, copy = self.tokens.result()
        tokens = read()
        return tokens, None if copy is None else copy.read()


class DecodeWorker:
    """Runs decode steps' forward passes and sampling in order on one worker thread."""

    def __init__(self, runner, sampling_step, sampler: Sampler,
                 sampling_batch: SamplingBatch):
        """``runner.forward(batch) -> hidden`` and ``sampling_step.compute_logits(hidden)
        -> logits`` are looked up at each step (a benchmark's stand-ins replace them)."""
        self.runner = runner
        self.sampling_step = sampling_step
        self.sampler = sampler
        self.sampling_batch = sampling_batch
        # The current CUDA device belongs to a thread: the worker makes the model's its own
        # (device_setup.py), or its graphs, launches and events would land on GPU 0.
        device = getattr(runner, "device", None)
        self._thread = ThreadPoolExecutor(
            1, thread_name_prefix="radixlm-decode",
            initializer=None if device is None else make_device_current,
            initargs=() if device is None else (device,))

    def launch(self, reqs: list[Req], batch: ForwardBatch,
               previous: DecodeInFlight | None) -> DecodeInFlight:
        """Queues the decode of ``reqs`` (whose KV slots ``batch`` holds).

        ``previous``: the step in flight whose tokens are this step's inputs; ``reqs`` are
        its requests in order, less some (their sampling rows are dropped first). None:
        ``batch.input_ids`` already holds the inputs.
        """
        keep, leaving = None, []
        if previous is not None and len(reqs) < len(previous.reqs):
            staying = {id(req) for req in reqs}
            rows = [row for row, req in enumerate(previous.reqs) if id(req) in staying]
            keep = to_device(rows, torch.int64, batch.input_ids.device)
            leaving = [req for req in previous.reqs if id(req) not in staying]
        step = DecodeInFlight(reqs, [row for row, r in enumerate(reqs) if r.logprobs is not None])
        if previous is None:
            step.host_ready.set()
        top_k = max((reqs[row].logprobs.top_k for row in step.logprob_rows), default=0)
        step.tokens = self._thread.submit(self._run, batch, previous, keep, leaving,
                                          step.logprob_rows, top_k, step.host_ready)
        return step

    def shutdown(self) -> None:
        """Stops the worker thread once its queued steps have run."""
        self._thread.shutdown(wait=True)

    def _run(self, batch: ForwardBatch, previous: DecodeInFlight | None,
             keep: torch.Tensor | None, leaving: list[Req], logprob_rows: list[int],
             top_k: int, host_ready: threading.Event,
             ) -> tuple[torch.Tensor, Callable[[], list[int]], LogprobCopy | None]:
        if leaving:
            self.sampling_batch.remove(leaving)
        if previous is not None:
            tokens, *_ = previous.tokens.result()  # done: this thread ran it
            batch.input_ids = tokens if keep is None else tokens.index_select(0, keep)
        hidden = self.runner.forward(batch)
        logits = self.sampling_step.compute_logits(hidden)  # (B, V)
        if self.sampling_batch.uses(GRAMMAR):
            host_ready.wait()  # the matchers have accepted the previous step's tokens
        next_ids = self.sampler.sample(logits, self.sampling_batch)  # (B,)
        self.sampling_batch.record_sampled(next_ids)
        copy = None
        if logprob_rows:  # started here, read by the host with the tokens (host_outputs)
            rows = to_device(logprob_rows, torch.int64, logits.device)
            copy = LogprobCopy.start(logits.index_select(0, rows),
                                     next_ids.index_select(0, rows), top_k)
        return next_ids, _start_copy_to_host(next_ids), copy


def _start_copy_to_host(tokens: torch.Tensor) -> Callable[[], list[int]]:
    """Starts copying ``tokens`` to the host and returns what waits for that copy. On CUDA
    the copy goes into pinned memory behind the step's kernels, and the wait is on an
    event recorded after it: the next step's kernels, queued later, are not waited for."""
    if tokens.device.type != "cuda":
        return tokens.tolist
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def read() -> list[int]:
        copied.synchronize()
        return host.tolist()

    return read
