"""A guard that finds every device-to-host read (and every upload from pageable memory) a
step of the runtime makes, while the runtime runs on the CPU.

On a CPU the "device" and the host share memory, so nothing waits; on a GPU each of these
makes the host wait for the device (a read waits for the kernels that produce the value;
a ``.to(device)`` or ``torch.tensor(..., device=)`` from pageable memory waits for the
stream). The guard tells the two kinds of CPU tensor apart by where they came from:

- device tensors are those made with an explicit ``device=`` (or moved with
  ``.to(device)``), and every output of an op that read a device tensor;
- every other tensor is host memory (``torch.tensor(values)``, ``pin_memory()``, lists
  turned into index tensors by an indexing call).

It then records, under a ``TorchFunctionMode`` and a ``TorchDispatchMode``:

- reads: ``.tolist()``, ``.numpy()``, ``.cpu()``, ``.item()`` / ``int()`` / ``float()`` /
  ``bool()`` / use as an index (``_local_scalar_dense``), ops whose output size depends on
  a device tensor's values (``nonzero``, ``unique``, ``masked_select``, a boolean-mask
  index, ``repeat_interleave`` without ``output_size``), and copies from device to host;
- uploads: a host tensor of one or more dimensions handed to an op on device tensors (an
  index list, ``copy_`` from the host), ``.to(device)`` of a host tensor and
  ``torch.tensor(..., device=)`` anywhere but in ``radixlm/host_to_device.py``, the one
  place that uploads from pinned memory.

Each finding keeps its call chain inside the ``radixlm`` package (``path:qualname`` and
``path:line`` of each frame, innermost first); its site is the innermost frame, or, past
functions that read on their caller's behalf, the first frame outside them.

A ``.to("cpu")`` cannot be told from ``.to(device)`` on a CPU and counts as an upload or a
no-op: the runtime reads with ``.cpu()``, ``.tolist()`` and ``.item()``. Branches taken
only on CUDA (pinned copies, events) do not run here; their reads are the CPU branch's.

Modes are per thread: ``wrap`` runs a function (the overlap worker's step) under the guard
on whatever thread calls it.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import radixlm

PACKAGE = Path(radixlm.__file__).resolve().parent
UPLOADER = "radixlm/host_to_device.py"

aten = torch.ops.aten
_SIZE_FROM_VALUES = {
    aten.nonzero.default, aten._unique2.default, aten.unique_dim.default,
    aten.unique_consecutive.default, aten.masked_select.default, aten.argwhere.default,
    aten.nonzero_static.default,
}
"""Ops whose output's size depends on their input's values: the host waits to size it."""
_SCALAR_READS = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default}
_INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default,
             aten._index_put_impl_.default}
_READ_METHODS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu,
                 torch.Tensor.__array__}
_FACTORIES_FROM_VALUES = {torch.tensor, torch.as_tensor, torch.asarray}


@dataclass(frozen=True)
class Finding:
    """One read or upload: ``kind`` ("read" or "upload"), what did it, and where."""

    kind: str
    what: str
    frames: tuple[tuple[str, str], ...]
    """(``path:qualname``, ``path:line``) of each frame in the radixlm package, innermost
    first."""

    def frame(self, on_behalf: tuple[str, ...] = ()) -> tuple[str, str]:
        """The frame that made it: the innermost one not in ``on_behalf``."""
        for frame in self.frames:
            if frame[0] not in on_behalf:
                return frame
        return self.frames[-1] if self.frames else ("<outside radixlm>", "<outside radixlm>")

    def site(self, on_behalf: tuple[str, ...] = ()) -> str:
        return self.frame(on_behalf)[0]

    def describe(self, on_behalf: tuple[str, ...] = ()) -> str:
        site, line = self.frame(on_behalf)
        chain = " <- ".join(f[1] for f in self.frames[:6])
        return f"{self.kind} by {self.what} at {line} (site {site}; called from {chain})"

    def __str__(self) -> str:
        return self.describe()


class HostReadGuard:
    """Records reads and uploads while active (``with guard:``); ``marking()`` only marks
    what is made on the device (while the runtime is built)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._storages: dict[int, StorageWeakRef] = {}
        self._lock = threading.Lock()
        self.findings: list[Finding] = []
        self.recording = False
        self._function_mode: TorchFunctionMode | None = None
        self._dispatch_mode: TorchDispatchMode | None = None

    # Device memory ------------------------------------------------------------------------

    def mark(self, tensors) -> None:
        """Marks every tensor in ``tensors`` (any nesting) as device memory."""
        for t in tree_flatten(tensors)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == self.device.type:
                storage = t.untyped_storage()
                with self._lock:
                    self._storages[storage._cdata] = StorageWeakRef(storage)

    def on_device(self, t) -> bool:
        if not isinstance(t, torch.Tensor) or t.device.type != self.device.type:
            return False
        storage = t.untyped_storage()
        ref = self._storages.get(storage._cdata)
        if ref is None:
            return False
        if ref.expired():  # freed, and its address reused by a new storage
            with self._lock:
                self._storages.pop(storage._cdata, None)
            return False
        return True

    # Findings -----------------------------------------------------------------------------

    def record(self, kind: str, what: str) -> None:
        if not self.recording:
            return
        frames = call_chain(sys._getframe(1))
        if kind == "upload" and frames and frames[0][0].startswith(UPLOADER):
            return
        with self._lock:
            self.findings.append(Finding(kind, what, frames))

    def unexpected(self, allowed: dict[str, str], on_behalf: tuple[str, ...] = ()
                   ) -> list[Finding]:
        """Findings whose site (past ``on_behalf``) is not a key of ``allowed``."""
        return [f for f in self.findings if f.site(on_behalf) not in allowed]

    # Activation ---------------------------------------------------------------------------

    def __enter__(self) -> HostReadGuard:
        self._function_mode = _FunctionMode(self)
        self._dispatch_mode = _DispatchMode(self)
        self._function_mode.__enter__()
        self._dispatch_mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._dispatch_mode.__exit__(*exc)
        self._function_mode.__exit__(*exc)

    def wrap(self, function: Callable) -> Callable:
        """``function`` run under this guard on the thread that calls it."""
        def guarded(*args, **kwargs):
            with _FunctionMode(self), _DispatchMode(self):
                return function(*args, **kwargs)
        return guarded


def call_chain(frame) -> tuple[tuple[str, str], ...]:
    """(``path:qualname``, ``path:line``) of each frame inside the package, innermost
    first."""
    chain = []
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path.is_relative_to(PACKAGE):
            relative = f"radixlm/{path.relative_to(PACKAGE).as_posix()}"
            chain.append((f"{relative}:{frame.f_code.co_qualname}",
                          f"{relative}:{frame.f_lineno}"))
        frame = frame.f_back
    return tuple(chain)


def _names_device(value, device: torch.device) -> bool:
    if isinstance(value, torch.Tensor):
        return value.device.type == device.type
    if isinstance(value, (str, torch.device)):
        return torch.device(value).type == device.type
    return False


class _FunctionMode(TorchFunctionMode):
    """The reads and uploads that torch's Python API makes without dispatching on a CPU,
    and the tensors that a ``device=`` or ``.to(device)`` puts on the device."""

    def __init__(self, guard: HostReadGuard):
        super().__init__()
        self.guard = guard

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        guard = self.guard
        source = args[0] if args else None
        if func in _READ_METHODS and guard.on_device(source):
            guard.record("read", f"Tensor.{func.__name__}")
        out = func(*args, **kwargs)
        to_device = func is torch.Tensor.to and any(
            _names_device(a, guard.device) for a in (*args[1:], kwargs.get("device")))
        named_device = _names_device(kwargs.get("device"), guard.device)
        if to_device or named_device:
            if (to_device and not guard.on_device(source)) or func in _FACTORIES_FROM_VALUES:
                guard.record("upload", f"{getattr(func, '__name__', func)} from host memory")
            guard.mark(out)
        return out


class _DispatchMode(TorchDispatchMode):
    """Reads, implicit uploads, and device-ness carried from an op's inputs to its outputs."""

    def __init__(self, guard: HostReadGuard):
        super().__init__()
        self.guard = guard

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        guard = self.guard
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        device_inputs = [t for t in inputs if guard.on_device(t)]
        if device_inputs:
            self._check(func, args, kwargs, inputs, device_inputs)
        out = func(*args, **kwargs)
        if device_inputs:
            if func is aten.copy_.default and not guard.on_device(args[0]):
                pass  # a copy into host memory stays host memory
            else:
                guard.mark(out)
        return out

    def _check(self, func, args, kwargs, inputs, device_inputs) -> None:
        guard = self.guard
        name = str(func)
        if func in _SCALAR_READS:
            guard.record("read", f"{name} (.item(), int(), bool() or an index)")
        elif func in _SIZE_FROM_VALUES:
            guard.record("read", f"{name} (its size depends on the values)")
        elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            guard.record("read", f"{name} without output_size")
        elif func in _INDEXING and any(
                t is not None and t.dtype in (torch.bool, torch.uint8)
                for t in (args[1] if len(args) > 1 else ())):
            guard.record("read", f"{name} with a boolean mask")
        elif func is aten.copy_.default and not guard.on_device(args[0]):
            guard.record("read", "copy_ from the device into host memory")
        into_host = func is aten.copy_.default and not guard.on_device(args[0])
        if len(device_inputs) < len(inputs) and not into_host:
            host = [t for t in inputs if not guard.on_device(t) and t.dim() > 0]
            if host:
                guard.record("upload", f"{name} given a host tensor of shape "
                                       f"{tuple(host[0].shape)}")
