"""Which attention backend runs: ``auto`` resolved for the device, explicit names checked.

- ``auto``: on CUDA, flashinfer where the package imports and the model is not MLA, else
  triton where it imports, else torch_native; on CPUs, torch_native.
- ``flashinfer``: needs CUDA and the ``flashinfer`` package (the ``gpu`` extra); not for
  MLA models (their latent pool has no K/V pair for FlashInfer's paged wrappers).
- ``triton``: needs the ``triton`` package; on CPUs, also Triton's interpreter
  (``TRITON_INTERPRET=1`` set before radixlm imports its kernels), meant for tests.
- ``torch_native``: runs everywhere.

A backend that cannot run here raises ``ValueError`` saying what is missing, at start-up.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch

from radixlm.kernels.attention.attention_backend import AttentionBackend
from radixlm.kernels.cpu_ops.execution_plan import TORCH_CHOICES, CpuExecutionPlan

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("torch_native", "triton", "flashinfer")


@dataclass
class BackendRequest:
    """What selection needs to know: the asked-for name and what it would run on."""

    name: str
    device: torch.device
    uses_mla: bool = False

    def __post_init__(self) -> None:
        if self.name != "auto" and self.name not in BACKEND_NAMES:
            raise ValueError(
                f"attention_backend must be 'auto' or one of {BACKEND_NAMES}, got {self.name!r}"
            )


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why Triton kernels cannot run on ``device``, or None when they can."""
    if importlib.util.find_spec("triton") is None:
        return "it needs the triton package (pip install 'radixlm[gpu]' or pip install triton)"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and triton_kernels_interpreted():
        return None
    return (
        f"Triton kernels need a CUDA device, or on a CPU Triton's interpreter: set "
        f"TRITON_INTERPRET=1 in the environment before radixlm starts (slow; for tests); "
        f"the device here is {device}"
    )


def triton_kernels_interpreted() -> bool:
    """True when radixlm's Triton kernels were decorated under the interpreter.

    ``triton.jit`` picks the interpreter when a kernel module is imported, so this imports
    one (honouring ``TRITON_INTERPRET`` now, if no kernel module was imported before).
    """
    from triton.runtime.interpreter import InterpretedFunction

    from radixlm.kernels.triton_ops import kv_store

    return isinstance(kv_store._store_kv_kernel, InterpretedFunction)


def flashinfer_unavailable_reason(device: torch.device, uses_mla: bool) -> str | None:
    """Why the FlashInfer backend cannot run here, or None when it can."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"FlashInfer needs a CUDA device and the device here is {device}"
    if importlib.util.find_spec("flashinfer") is None:
        return "it needs the flashinfer package (pip install 'radixlm[gpu]')"
    if uses_mla:
        return "this model uses multi-head latent attention, which the FlashInfer " \
            "backend does not serve; use attention_backend='triton'"
    return None


def resolve_backend_name(request: BackendRequest) -> str:
    """The backend that will run: ``auto`` resolved; an explicit name checked."""
    device = request.device
    if request.name == "auto":
        if device.type != "cuda":
            return "torch_native"
        if flashinfer_unavailable_reason(device, request.uses_mla) is None:
            return "flashinfer"
        if triton_unavailable_reason(device) is None:
            return "triton"
        logger.warning("neither flashinfer nor triton is installed: attention runs in torch")
        return "torch_native"
    if request.name == "triton":
        reason = triton_unavailable_reason(device)
    elif request.name == "flashinfer":
        reason = flashinfer_unavailable_reason(device, request.uses_mla)
    else:
        reason = None
    if reason is not None:
        raise ValueError(f"attention_backend={request.name!r} cannot run here: {reason}")
    return request.name


def create_backend(
    name: str, device: torch.device, *, num_heads: int, num_kv_heads: int, head_dim: int,
    page_size: int, dtype: torch.dtype, scaling: float,
    cpu_plan: CpuExecutionPlan = TORCH_CHOICES,
) -> AttentionBackend:
    """Builds a resolved backend (see ``resolve_backend_name``) for a model's layers
    (``cpu_plan``: the model's CPU plan, which says where the fused kernels attend)."""
    if name == "torch_native":
        from radixlm.kernels.attention.torch_native_backend import TorchNativeAttentionBackend

        return TorchNativeAttentionBackend(cpu_plan)
    if name == "triton":
        from radixlm.kernels.attention.triton_backend import (
            TritonAttentionBackend,
            TritonBackendConfig,
        )

        return TritonAttentionBackend(TritonBackendConfig.for_device(device))
    if name == "flashinfer":
        from radixlm.kernels.attention.flashinfer_backend import (
            AttentionShape,
            FlashInferAttentionBackend,
        )

        shape = AttentionShape(num_heads, num_kv_heads, head_dim, page_size, dtype, scaling)
        return FlashInferAttentionBackend(shape, device)
    raise ValueError(f"unknown attention backend {name!r}; known: {BACKEND_NAMES}")
