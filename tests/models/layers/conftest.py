"""Fixtures of the layer tests."""

from __future__ import annotations

import pytest
from fused_kernels import enable_or_skip

from radixlm.kernels.cpu_ops import fused_ops


@pytest.fixture(params=["fused kernels", "torch"])
def cpu_kernels(request):
    """Each case with the fused CPU kernels on (few-row passes of packed weights run their
    matmuls) and off (torch's kernels); the process's setting is restored."""
    was_on = fused_ops.active() is not None
    if request.param == "torch":
        fused_ops.disable()
    else:
        enable_or_skip()
    yield request.param
    if was_on:
        fused_ops.enable()
    else:
        fused_ops.disable()
