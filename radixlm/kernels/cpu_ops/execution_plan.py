"""Which kernel runs each product of a model on a CPU: one plan, built once by the model runner
and held by every layer that multiplies.

A CPU product's kernel depends on the CPU (its flags: whether the fused kernels' column-pair
products beat oneDNN), on choices measured at start (torch's or the kernels' float32 one-row
product), on the serving options (whether the kernels get weight copies of their own) and on
the pass (a prompt pass keeps its products independent of its number of rows; a one-row
half-precision pass bypasses oneDNN). All of it is here: the runner builds the plan
(``runtime/model_executor/cpu_matmul_path.build_cpu_plan``), hands it to the loader, which
packs weights by it, to each linear layer and to the attention backend, and runs every pass
inside ``pass_scope``. Reading a layer's ``plan`` tells which kernel runs and why.

Invariants: the plan's choices are fixed once built; only ``pass_scope`` changes the per-pass
state (``prompt_pass`` and torch's oneDNN switch), restoring it on the way out, even on an
error (a runner's passes never overlap). A layer given no plan holds ``TORCH_CHOICES``,
which asks for no kernel copy, bypass or one-row kernel (and is never in a pass).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

FLOAT32_FUSED_ROWS = range(3, 17)
"""Rows of a float32 pass over a plain weight that run the kernels' ``dense_matmul`` (torch's
GEMM is the slower for them on every CPU measured; benchmarks/RESULTS.md)."""
FLOAT32_FUSED_ROWS_FROM_ONE = range(1, 17)
"""The same where the kernels' product of one and two rows is the faster too (measured at
start: ``cpu_matmul_path.choose_float32_matrix_vector``)."""


@dataclass(eq=False)
class CpuExecutionPlan:
    """The kernel choices of one model's CPU passes (see the module)."""

    pair_kernels: bool = False
    """bfloat16 products by the kernels' column pairs (``pair_matmul``), and bfloat16 prompt
    attention on the kernels: the kernels built with AVX-512 BF16, on a CPU without AMX
    (oneDNN's kernels run on AMX tiles there)."""
    keep_rows: bool = False
    """The kernels get weight copies of their own (column pairs, or plain rows beside
    oneDNN's layout for few-row passes): the kernels on and ``disable_cpu_weight_rows``
    unset."""
    float32_fused_rows: range = FLOAT32_FUSED_ROWS
    """Rows of float32 passes over plain weights that run ``dense_matmul``."""
    one_row_bypass: bool = False
    """Half-precision passes of one row run with oneDNN off (torch's matrix-vector kernel):
    16-bit weights not in oneDNN's layout, on a torch with oneDNN."""
    prompt_pass: bool = False
    """Set for the duration of a prompt (extend) pass by ``pass_scope``: products over
    oneDNN's layout then all run on oneDNN, whose products do not depend on the pass's
    rows."""

    @contextlib.contextmanager
    def pass_scope(self, rows: int, prompt: bool) -> Iterator[None]:
        """Runs one pass of ``rows`` rows (a prompt pass where ``prompt``) under this plan; a
        pass inside a prompt pass (its logits, say) stays a prompt pass, and each scope
        restores what it found."""
        bypass = self.one_row_bypass and rows == 1 and torch.backends.mkldnn.enabled
        outer, self.prompt_pass = self.prompt_pass, prompt or self.prompt_pass
        if bypass:
            torch.backends.mkldnn.enabled = False
        try:
            yield
        finally:
            self.prompt_pass = outer
            if bypass:
                torch.backends.mkldnn.enabled = True


TORCH_CHOICES = CpuExecutionPlan()
"""The plan of a layer no runner has planned: torch's products but for the fused kernels'
float32 few-row product, no kernel copies, no bypass."""
