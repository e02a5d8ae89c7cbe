"""What a benchmark prints about the machine it ran on, since figures differ between CPUs."""

from __future__ import annotations

import contextlib
import os

import torch

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16")


def cpu_flags() -> str:
    """The CPU's flags that decide the kernels' speed ("unknown" without /proc/cpuinfo)."""
    with contextlib.suppress(OSError, StopIteration), open("/proc/cpuinfo") as info:
        flags = next(line for line in info if line.startswith("flags")).split()
        return " ".join(f for f in CPU_FLAGS if f in flags)
    return "unknown"


def describe_machine() -> str:
    """One line: cores, the CPU's flags and the level torch's kernels run at."""
    return (f"cpu: {os.cpu_count()} cores, flags {cpu_flags()}, torch kernels at "
            f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")


def openmp_setting() -> str:
    """The OpenMP wait settings the benchmark's processes inherit: a user's
    ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` overrides radixlm's short spin
    (``radixlm.openmp_policy``); PASSIVE made the GGUF decode steps wait on libgomp's wakes
    (benchmarks/RESULTS.md)."""
    from radixlm.openmp_policy import SHORT_SPIN_COUNT

    chosen = [f"{name}={os.environ[name]}" for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
              if name in os.environ]
    if chosen in ([], [f"GOMP_SPINCOUNT={SHORT_SPIN_COUNT}"]):  # (set by ``import radixlm``)
        return "radixlm's short spin"
    return ", ".join(chosen) + " (set by the caller)"
