"""Kernel tests run Triton kernels on the GPU where CUDA is available, and on the CPU
through Triton's interpreter where it is not.

``triton.jit`` picks the interpreter when it decorates a kernel, so ``TRITON_INTERPRET``
must be set before any ``radixlm.kernels.triton_*`` module is imported; it is set here, at
collection, only without CUDA, and left set for the session (without CUDA, Triton can run
nothing else, so no other test loses anything). Engine processes started later inherit it.
With CUDA it is left unset, and the Triton tests put their tensors on the GPU
(``kernel_device.KERNEL_DEVICE``): the compiled kernels cannot read host memory.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
