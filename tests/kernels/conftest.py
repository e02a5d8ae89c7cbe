"""Kernel tests run Triton kernels on the CPU through Triton's interpreter when there is no GPU.

``triton.jit`` picks the interpreter when it decorates a kernel, so ``TRITON_INTERPRET``
must be set before any ``radixlm.kernels.triton_*`` module is imported; it is set here, at
collection, and left set for the session (without CUDA, Triton can run nothing else, so
no other test loses anything). Engine processes started later inherit it.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
