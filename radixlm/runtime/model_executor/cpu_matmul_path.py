"""Which kernels a CPU forward pass's half-precision matmuls, and its float32 passes of one
or two rows, run on.

torch hands a bfloat16 / float16 matmul to oneDNN where the CPU has AVX-512. For many rows
that is the fast path; for one row (a batch-1 decode step, or its logits) oneDNN sets up a
general matrix product and reads the weights at about half the speed of torch's own
matrix-vector kernel, which it skips for (the default model's bf16 decode step, 2 cores:
benchmarks/RESULTS.md). So a one-row pass in half
precision runs with oneDNN disabled; every other pass, and every float32 pass, is left as
it is. Where the projections are laid out for oneDNN (``models/layers/cpu_weight_layout``:
bfloat16 without a weight-only format) oneDNN is faster for one row too, and nothing is
bypassed (default model, AMX CPU, 2 threads: a bf16 decode step is faster without the
bypass than with it, and both faster than before the layout).

The switch is torch's process-wide ``torch.backends.mkldnn.enabled``, flipped for a pass by
the plan's ``pass_scope``: forward passes of a runner must not overlap (the scheduler runs
them one at a time).

A float32 pass of one or two rows (batch-1 and -2 decode) runs either torch's matrix-vector
kernel (MKL's) or the fused kernels' ``dense_matmul``, whichever is the faster here, which
differs between CPUs: on a 2-core AMX CPU torch's, on a 2-core Zen 4 the kernels' (MKL's
kernel took no less time on two threads than on one there; figures in
benchmarks/RESULTS.md).
``choose_float32_matrix_vector`` measures both once a process, on a weight larger than the
CPU's caches.

``build_cpu_plan`` puts these choices, and the CPU's, into the runner's
``CpuExecutionPlan`` (``kernels/cpu_ops/execution_plan.py``).
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from radixlm.kernels.cpu_ops import fused_ops
from radixlm.kernels.cpu_ops.execution_plan import (
    FLOAT32_FUSED_ROWS,
    FLOAT32_FUSED_ROWS_FROM_ONE,
    CpuExecutionPlan,
)
from radixlm.models.layers.cpu_weight_layout import uses_blocked_layout

logger = logging.getLogger(__name__)

PROBE_SHAPE = (4096, 4096)  # float32, 64 MiB: past the last-level caches of these CPUs
PROBE_ROUNDS = 4
KERNEL_MARGIN = 0.9  # the kernels' time must be below this share of torch's to be chosen
_float32_choice: bool | None = None  # measured once a process

_HALF_DTYPES = (torch.bfloat16, torch.float16)


def uses_matrix_vector_path(device: torch.device, dtype: torch.dtype,
                            weight_format: str | None = None) -> bool:
    """True where one-row passes should bypass oneDNN: half precision on a CPU whose torch
    has oneDNN, unless the model's weights are in oneDNN's layout (``uses_blocked_layout``)."""
    if uses_blocked_layout(device, dtype, weight_format):
        return False
    return (device.type == "cpu" and dtype in _HALF_DTYPES
            and torch.backends.mkldnn.is_available())


def build_cpu_plan(device: torch.device, dtype: torch.dtype, weight_format: str | None,
                   kernels_on: bool, keep_rows: bool, measure: bool) -> CpuExecutionPlan:
    """The plan of a model's CPU passes: the kernels' column pairs where they pay on this CPU,
    their own weight copies where ``keep_rows`` (and the kernels are on), the one-row oneDNN
    bypass, and, in float32 where ``measure``, the one-row product measured faster here
    (else torch's)."""
    if device.type != "cpu":
        return CpuExecutionPlan()
    one_row_kernel = (kernels_on and measure and dtype == torch.float32
                      and choose_float32_matrix_vector())
    return CpuExecutionPlan(
        pair_kernels=kernels_on and fused_ops.pair_kernels_pay(),
        keep_rows=kernels_on and keep_rows,
        float32_fused_rows=FLOAT32_FUSED_ROWS_FROM_ONE if one_row_kernel else FLOAT32_FUSED_ROWS,
        one_row_bypass=uses_matrix_vector_path(device, dtype, weight_format),
    )


def choose_float32_matrix_vector() -> bool:
    """Measures (once a process; later calls return the first answer) whether the fused
    kernels' ``dense_matmul`` multiplies one float32 row faster than torch's ``F.linear``
    here, by a clear margin (``KERNEL_MARGIN``). False, without measuring, where the kernels
    are off."""
    global _float32_choice
    if _float32_choice is None:
        kernels = fused_ops.active()
        if kernels is None:
            return False
        torch_s, kernel_s = _time_one_row(kernels)
        _float32_choice = kernel_s < KERNEL_MARGIN * torch_s
        logger.info("float32 one-row matmul, %d x %d weight: torch %.2f ms, fused kernel "
                    "%.2f ms: %s's", *PROBE_SHAPE, torch_s * 1e3, kernel_s * 1e3,
                    "the kernel" if _float32_choice else "torch")
    return _float32_choice


def _time_one_row(kernels) -> tuple[float, float]:
    """Best seconds of ``F.linear`` and of ``dense_matmul`` for one row against a float32
    weight of ``PROBE_SHAPE``, the two taken in turns ``PROBE_ROUNDS`` times."""
    weight = torch.full(PROBE_SHAPE, 0.5)
    row = torch.ones(1, PROBE_SHAPE[1])
    products = (lambda: F.linear(row, weight), lambda: kernels.dense_matmul(row, weight))
    best = [float("inf"), float("inf")]
    for _ in range(PROBE_ROUNDS):
        for i, product in enumerate(products):
            start = time.perf_counter()
            product()
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0], best[1]
