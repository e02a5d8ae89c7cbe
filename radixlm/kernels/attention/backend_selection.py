"""Which attention backend runs: ``auto`` resolved for the device, dtype and head size;
explicit names checked. The choice and its reason are logged at start-up.

- ``auto``: on CUDA, flashinfer where the package imports, the model is not MLA, the dtype is
  16-bit (``FLASHINFER_DTYPES``) and the head size is one FlashInfer has kernels for
  (``FLASHINFER_HEAD_DIMS``); else triton where it imports, else torch_native. On CPUs,
  torch_native.
- ``flashinfer``: needs CUDA and the ``flashinfer`` package (the ``gpu`` extra), a float16 or
  bfloat16 model and a head size in ``FLASHINFER_HEAD_DIMS``; not for MLA models (their
  latent pool has no K/V pair for FlashInfer's paged wrappers).
- ``triton``: needs the ``triton`` package; on CPUs, also Triton's interpreter
  (``TRITON_INTERPRET=1`` set before radixlm imports its kernels), meant for tests.
- ``torch_native``: runs everywhere.

A backend that cannot run here raises ``ValueError`` saying what is missing, at start-up.
The decision itself (``select_backend``) is a pure function of the request and of what the
machine offers (``HostSupport``); ``resolve_backend_name`` probes the machine and logs it.
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

FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
"""Model (and KV) dtypes FlashInfer has attention kernels for: its dtype dispatch tables
stop at 16 bits (fp8 KV aside, which radixlm does not use); there is no float32 kernel."""

FLASHINFER_HEAD_DIMS = (64, 128, 256)
"""Head sizes FlashInfer's paged prefill and decode kernels are instantiated for: the cases
of its ``DISPATCH_HEAD_DIM`` switch (``include/flashinfer/utils.cuh``) and the head sizes its
prebuilt kernels are compiled for, as read from flashinfer-python 0.7.4's source for issue
58 (the package is not installed on the CPU machines that test this). Any other head size is
served by Triton rather than risk a kernel FlashInfer does not have."""


@dataclass
class BackendRequest:
    """What selection needs to know: the asked-for name, what it would run on, and the
    attention's shape that decides whether a kernel exists (dtype, head size)."""

    name: str
    device: torch.device
    dtype: torch.dtype
    head_dim: int
    uses_mla: bool = False

    def __post_init__(self) -> None:
        if self.name != "auto" and self.name not in BACKEND_NAMES:
            raise ValueError(
                f"attention_backend must be 'auto' or one of {BACKEND_NAMES}, got {self.name!r}"
            )
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"BackendRequest.dtype must be a torch.dtype, got {self.dtype!r}")
        if not isinstance(self.head_dim, int) or self.head_dim <= 0:
            raise ValueError(
                f"BackendRequest.head_dim must be a positive integer, got {self.head_dim!r}")


@dataclass(frozen=True)
class HostSupport:
    """What this machine offers the backends: selection's inputs that are not in the request."""

    cuda_available: bool
    flashinfer_installed: bool
    triton_reason: str | None
    """Why Triton cannot run on the request's device, None when it can (probed only where
    selection reads it: ``auto`` on CUDA, or an explicit ``triton``)."""

    @classmethod
    def probe(cls, request: BackendRequest) -> HostSupport:
        needs_triton = request.device.type == "cuda" or request.name == "triton"
        return cls(
            cuda_available=torch.cuda.is_available(),
            flashinfer_installed=importlib.util.find_spec("flashinfer") is not None,
            triton_reason=triton_unavailable_reason(request.device) if needs_triton else None,
        )


@dataclass(frozen=True)
class BackendChoice:
    """The backend that will run and why it was chosen (logged at start-up)."""

    name: str
    reason: str


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


def flashinfer_unavailable_reason(request: BackendRequest, host: HostSupport) -> str | None:
    """Why the FlashInfer backend cannot serve ``request`` on ``host``, or None when it can."""
    device = request.device
    if device.type != "cuda" or not host.cuda_available:
        return f"FlashInfer needs a CUDA device and the device here is {device}"
    if not host.flashinfer_installed:
        return "it needs the flashinfer package (pip install 'radixlm[gpu]')"
    if request.uses_mla:
        return "this model uses multi-head latent attention, which the FlashInfer " \
            "backend does not serve; use attention_backend='triton'"
    if request.dtype not in FLASHINFER_DTYPES:
        dtype = str(request.dtype).removeprefix("torch.")
        return (f"FlashInfer has no {dtype} kernels (only float16 and bfloat16); "
                f"use dtype='bfloat16' or attention_backend='triton'")
    if request.head_dim not in FLASHINFER_HEAD_DIMS:
        return (f"FlashInfer has no kernels for head size {request.head_dim} (only "
                f"{', '.join(map(str, FLASHINFER_HEAD_DIMS))}); use attention_backend='triton'")
    return None


def select_backend(request: BackendRequest, host: HostSupport) -> BackendChoice:
    """The backend that will run and why: ``auto`` resolved; an explicit name checked
    (ValueError naming what is missing). Pure: reads nothing but its arguments."""
    device = request.device
    if request.name == "auto":
        if device.type != "cuda":
            return BackendChoice("torch_native", f"the device is {device}, not CUDA")
        flashinfer_reason = flashinfer_unavailable_reason(request, host)
        if flashinfer_reason is None:
            dtype = str(request.dtype).removeprefix("torch.")
            return BackendChoice("flashinfer", f"FlashInfer has {dtype} kernels for head "
                                               f"size {request.head_dim}")
        if host.triton_reason is None:
            return BackendChoice("triton", f"not flashinfer: {flashinfer_reason}")
        return BackendChoice("torch_native", f"not flashinfer: {flashinfer_reason}; "
                                             f"not triton: {host.triton_reason}")
    if request.name == "triton":
        reason = host.triton_reason
    elif request.name == "flashinfer":
        reason = flashinfer_unavailable_reason(request, host)
    else:
        reason = None
    if reason is not None:
        raise ValueError(f"attention_backend={request.name!r} cannot run here: {reason}")
    return BackendChoice(request.name, "named by attention_backend")


def resolve_backend_name(request: BackendRequest) -> str:
    """The backend that will run on this machine (``select_backend`` over what it offers),
    its choice and reason logged."""
    choice = select_backend(request, HostSupport.probe(request))
    # auto falling back to torch on a GPU is slow enough to warn about
    fell_back = request.name == "auto" and request.device.type == "cuda" and (
        choice.name == "torch_native")
    (logger.warning if fell_back else logger.info)(
        "attention backend %s: %s", choice.name, choice.reason)
    return choice.name


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
