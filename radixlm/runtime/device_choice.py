"""Which device and dtype the options resolve to on this machine, and why a chosen dtype may
be a poor one (``ServerArgs.resolved_device``, ``resolved_dtype``, ``dtype_warning``).

Light to import: torch loads only when a function runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def resolved_device(device: str) -> torch.device:
    """``device`` ("auto", "cpu", "cuda[:N]") as a torch device: "auto" is CUDA where there
    is one."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolved_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``dtype`` as a torch dtype: "auto" is bfloat16 on CUDA and on CPUs with native bf16,
    float32 on other CPUs."""
    import torch

    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def dtype_warning(dtype: str, device: torch.device) -> str | None:
    """Why ``dtype`` is a poor choice on ``device``, or None.

    On a CPU without native bf16, bf16 matmuls are emulated (about 9x slower than float32)
    and round differently from CPUs that have it, so a greedy answer near a tie can differ
    from both float32's and a native-bf16 machine's."""
    if dtype != "bfloat16" or device.type != "cpu" or cpu_has_native_bf16():
        return None
    return (
        "dtype=bfloat16 on a CPU without native bf16 (AVX512-BF16 or AMX) is slow (its "
        "matmuls are emulated, several times slower than float32) and imprecise (answers "
        "near a tie differ from float32's and from a native-bf16 CPU's); dtype=auto "
        "picks float32 here"
    )


def cpu_has_native_bf16() -> bool:
    """True where the CPU computes bf16 matmuls natively (AVX512-BF16 or AMX) and torch's
    kernels run at that level (``ATEN_CPU_CAPABILITY=avx2`` holds them back to AVX2)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    has_flag = "avx512_bf16" in flags or "amx_bf16" in flags
    import torch

    return has_flag and torch.backends.cpu.get_cpu_capability() == "AVX512"
