"""Where the kernel tests put the tensors they hand Triton: the GPU where CUDA is available
(the kernels compile for it, and Triton reads only device memory), else the CPU, where
``conftest.py`` has set ``TRITON_INTERPRET=1`` and the kernels run as numpy.

Tests build their inputs with CPU generators (the same values on every machine) and move
them here; references may run anywhere, outputs are compared on this device.
"""

from __future__ import annotations

import torch

KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
