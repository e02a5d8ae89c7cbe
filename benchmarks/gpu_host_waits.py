"""Host waits per decode step on a CUDA GPU, with overlap and CUDA graphs on and off.

Part of ``benchmarks/gpu_check.sh`` (issue 58). A host wait (a device-to-host read, a
synchronizing copy) in the step loop stops the host from queueing step N+1 while step N
runs. Here the real scheduler (``build_scheduler``, in this process) serves a batch of
greedy requests on a randomly initialised small Llama (written by
``bench_gpu_decode.write_random_llama``; nothing is downloaded), and ``SyncCounter`` counts
the host waits of the whole measured loop (every ``scheduler.step()`` and the drain after
it), on every thread, the overlap worker's included:

- the calls ``torch.cuda.set_sync_debug_mode("warn")`` flags (device-to-host copies,
  ``.item()`` / ``.tolist()`` of a device tensor, stream synchronizations), seen through a
  process-wide ``warnings.showwarning`` hook, which every thread's warnings reach;
- ``torch.cuda.Event.synchronize`` and ``torch.cuda.synchronize``, which sync debug mode
  does not flag (overlap's wait for a step's tokens is an event's), counted by wrapping
  them for the same span.

A wait inside a C++ extension that calls the CUDA runtime itself is not seen. Waits are
given to the step the main thread was in when they happened: with overlap, the worker's
waits for step N+1 may fall in step N. The output line gives the waits in decode steps,
per decode step, and the loop's total (prefill steps and the drain included). The declared
reads (``radixlm/runtime/scheduler/host_reads.py``, the sampled tokens above all) are
expected: one or two per decode step is the design, more is a regression.

    python benchmarks/gpu_host_waits.py [--backend triton] [--dtype bfloat16]

CUDA only (exits 2 without it). ``gpu_check.sh`` runs it under a time limit (a budget the
first GPU run calibrates, not a measurement).
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]

from bench_gpu_decode import write_random_llama  # noqa: E402
from runtime_checks import scheduler_req  # noqa: E402
from workloads import greedy, random_ids  # noqa: E402

from radixlm.runtime.scheduler.scheduler_process import build_scheduler  # noqa: E402
from radixlm.runtime.server_args import ServerArgs  # noqa: E402

MODEL = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, vocab_size=4096)
BATCH, PROMPT, NEW_TOKENS = 8, 64, 32


def set_sync_debug_mode(mode: str) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode(mode)


class SyncCounter:
    """While entered: every host wait in the process, on any thread, as a call site.

    Installs process-wide state and restores it on exit: sync debug mode "warn", a
    ``warnings`` filter showing every synchronization warning (not once per site), a
    ``warnings.showwarning`` that records those and passes the rest on, and wrappers around
    ``torch.cuda.Event.synchronize`` and ``torch.cuda.synchronize``. A wait is recorded
    once: a warning raised inside a wrapped call is left to the wrapper. ``take()`` hands
    over the sites recorded since the last ``take()``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sites: list[str] = []
        self._inside = threading.local()  # this thread is in a wrapped call

    def take(self) -> list[str]:
        with self._lock:
            taken, self._sites = self._sites, []
        return taken

    def _record(self, site: str) -> None:
        with self._lock:
            self._sites.append(site)

    def _show(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):
            self._showwarning(message, category, filename, lineno, file, line)
        elif not getattr(self._inside, "active", False):
            self._record(f"{Path(filename).name}:{lineno}")

    def _wrap(self, original, label: str):
        def wrapper(*args, **kwargs):
            caller = sys._getframe(1)
            self._record(f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno} ({label})")
            outer, self._inside.active = getattr(self._inside, "active", False), True
            try:
                return original(*args, **kwargs)
            finally:
                self._inside.active = outer

        return wrapper

    def __enter__(self) -> SyncCounter:
        self._filters = list(warnings.filters)
        self._showwarning = warnings.showwarning
        self._event_synchronize = torch.cuda.Event.synchronize
        self._device_synchronize = torch.cuda.synchronize
        warnings.filterwarnings("always", message=".*synchroniz")
        warnings.showwarning = self._show
        torch.cuda.Event.synchronize = self._wrap(self._event_synchronize, "Event.synchronize")
        torch.cuda.synchronize = self._wrap(self._device_synchronize, "cuda.synchronize")
        set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        set_sync_debug_mode("default")
        torch.cuda.synchronize = self._device_synchronize
        torch.cuda.Event.synchronize = self._event_synchronize
        warnings.showwarning = self._showwarning
        # "always" writes no per-module registry entries, so none need resetting.
        warnings.filters[:] = self._filters


def count_waits(model_dir: str, backend: str, dtype: str, overlap: bool, graphs: bool,
                device: str = "cuda") -> str:
    """One configuration's line: decode steps, host waits in them and in the whole loop,
    the busiest sites."""
    args = ServerArgs(model_dir, attention_backend=backend, dtype=dtype, device=device,
                      disable_overlap_schedule=not overlap, disable_cuda_graph=not graphs,
                      cuda_graph_max_bs=BATCH, max_running_requests=BATCH,
                      max_total_tokens=4 * BATCH * (PROMPT + NEW_TOKENS),
                      context_length=PROMPT + NEW_TOKENS + 16)
    scheduler = build_scheduler(args, model_dir)
    sites: collections.Counter[str] = collections.Counter()
    in_decode = total = 0
    try:
        for warm_up in (True, False):
            reqs = [scheduler_req(scheduler, random_ids(i, PROMPT), greedy(NEW_TOKENS))
                    for i in range(BATCH)]
            for req in reqs:
                scheduler.add_request(req)
            stats = scheduler.state.stats
            if warm_up:
                for _ in decode_loop(scheduler, reqs):
                    pass
                scheduler.drain()
                continue
            decode_before = stats.decode_steps
            with SyncCounter() as counter:
                for decoding in decode_loop(scheduler, reqs):
                    found = counter.take()
                    total += len(found)
                    if decoding:
                        in_decode += len(found)
                        sites.update(found)
                scheduler.drain()
                total += len(counter.take())
        steps = stats.decode_steps - decode_before
    finally:
        scheduler.shutdown()
    busiest = ", ".join(f"{site} x{n}" for site, n in sites.most_common(6)) or "none"
    per_step = in_decode / steps if steps else float("nan")
    return (f"{backend} {dtype} overlap={'on' if overlap else 'off'} "
            f"graphs={'on' if graphs else 'off'}: {steps} decode steps, {in_decode} host "
            f"waits in them ({per_step:.2f} per step; any thread, by the main thread's step "
            f"at the time), {total} in the whole loop; sites: {busiest}")


def decode_loop(scheduler, reqs) -> Iterator[bool]:
    """Steps the scheduler until ``reqs`` finish, yielding after each step whether it
    decoded."""
    stats = scheduler.state.stats
    for _ in range(10 * NEW_TOKENS):
        if all(req.finished for req in reqs):
            return
        before = stats.decode_steps
        scheduler.step()
        yield stats.decode_steps > before


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA: skipped")
        return 2
    failures = 0
    with tempfile.TemporaryDirectory() as directory:
        write_random_llama(Path(directory), MODEL, getattr(torch, args.dtype),
                           torch.device("cuda"), PROMPT + NEW_TOKENS + 16)
        for overlap in (True, False):
            for graphs in (True, False):
                try:
                    print(count_waits(directory, args.backend, args.dtype, overlap, graphs),
                          flush=True)
                except Exception as err:  # report each configuration, then fail
                    failures += 1
                    print(f"ERROR overlap={overlap} graphs={graphs}: "
                          f"{type(err).__name__}: {err}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
