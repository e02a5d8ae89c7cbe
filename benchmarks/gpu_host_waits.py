"""Host waits per decode step on a CUDA GPU, with overlap and CUDA graphs on and off.

Part of ``benchmarks/gpu_check.sh`` (issue 58). A host wait (a device-to-host read, a
synchronizing copy) in the step loop stops the host from queueing step N+1 while step N
runs. Here the real scheduler (``build_scheduler``, in this process) serves a batch of
greedy requests on a randomly initialised small Llama (written by
``bench_gpu_decode.write_random_llama``; nothing is downloaded) under
``torch.cuda.set_sync_debug_mode("warn")``, which warns at every synchronizing CUDA call on
any thread; the warnings issued during decode steps are counted, per step, and their call
sites listed. The declared reads (``radixlm/runtime/scheduler/host_reads.py``, the sampled
tokens above all) are expected: one or two per step is the design, more is a regression.

    python benchmarks/gpu_host_waits.py [--backend triton] [--dtype bfloat16]

CUDA only (exits 2 without it); about a minute, most of it capturing graphs.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import warnings
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


def count_waits(model_dir: str, backend: str, dtype: str, overlap: bool, graphs: bool,
                device: str = "cuda") -> str:
    """One configuration's line: decode steps, host waits per step, the busiest sites."""
    args = ServerArgs(model_dir, attention_backend=backend, dtype=dtype, device=device,
                      disable_overlap_schedule=not overlap, disable_cuda_graph=not graphs,
                      cuda_graph_max_bs=BATCH, max_running_requests=BATCH,
                      max_total_tokens=4 * BATCH * (PROMPT + NEW_TOKENS),
                      context_length=PROMPT + NEW_TOKENS + 16)
    scheduler = build_scheduler(args, model_dir)
    sites: collections.Counter[str] = collections.Counter()
    try:
        for warm_up in (True, False):
            reqs = [scheduler_req(scheduler, random_ids(i, PROMPT), greedy(NEW_TOKENS))
                    for i in range(BATCH)]
            for req in reqs:
                scheduler.add_request(req)
            stats = scheduler.state.stats
            decode_before, waits = stats.decode_steps, 0
            set_sync_debug_mode("warn")
            try:
                for _ in range(10 * NEW_TOKENS):
                    if all(req.finished for req in reqs):
                        break
                    decoding = stats.decode_steps
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        scheduler.step()
                    if stats.decode_steps > decoding and not warm_up:
                        found = [w for w in caught if "synchroniz" in str(w.message)]
                        waits += len(found)
                        sites.update(f"{Path(w.filename).name}:{w.lineno}" for w in found)
            finally:
                set_sync_debug_mode("default")
            scheduler.drain()
        steps = stats.decode_steps - decode_before
    finally:
        scheduler.shutdown()
    busiest = ", ".join(f"{site} x{n}" for site, n in sites.most_common(6)) or "none"
    per_step = waits / steps if steps else float("nan")
    return (f"{backend} {dtype} overlap={'on' if overlap else 'off'} "
            f"graphs={'on' if graphs else 'off'}: {steps} decode steps, {waits} host waits, "
            f"{per_step:.2f} per step; sites: {busiest}")


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
