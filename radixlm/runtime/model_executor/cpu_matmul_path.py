"""Which kernels a CPU forward pass's half-precision matmuls run on.

torch hands a bfloat16 / float16 matmul to oneDNN where the CPU has AVX-512. For many rows
that is the fast path; for one row (a batch-1 decode step, or its logits) oneDNN sets up a
general matrix product and reads the weights at about half the speed of torch's own
matrix-vector kernel, which it skips for (measured on the default model, 2 cores: 37 ms of
matmuls per bf16 decode step through oneDNN, 17 ms without). So a one-row pass in half
precision runs with oneDNN disabled; every other pass, and every float32 pass, is left as
it is. Where the projections are laid out for oneDNN (``models/layers/cpu_weight_layout``:
bfloat16 without a weight-only format) oneDNN is faster for one row too, and nothing is
bypassed (default model, AMX CPU, 2 threads: a bf16 decode step 24.1 ms without the bypass,
26.3 with it; 31.3 before the layout).

The switch is torch's process-wide ``torch.backends.mkldnn.enabled``: forward passes of a
runner must not overlap (the scheduler runs them one at a time).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from radixlm.models.layers.cpu_weight_layout import uses_blocked_layout

_HALF_DTYPES = (torch.bfloat16, torch.float16)


def uses_matrix_vector_path(device: torch.device, dtype: torch.dtype,
                            weight_format: str | None = None) -> bool:
    """True where one-row passes should bypass oneDNN: half precision on a CPU whose torch
    has oneDNN, unless the model's weights are in oneDNN's layout (``uses_blocked_layout``)."""
    if uses_blocked_layout(device, dtype, weight_format):
        return False
    return (device.type == "cpu" and dtype in _HALF_DTYPES
            and torch.backends.mkldnn.is_available())


@contextlib.contextmanager
def matrix_vector_path(active: bool) -> Iterator[None]:
    """Runs the block with oneDNN disabled when ``active`` (then restores the setting)."""
    if not active or not torch.backends.mkldnn.enabled:
        yield
        return
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = True
