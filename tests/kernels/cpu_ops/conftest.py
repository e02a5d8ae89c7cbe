"""The fused CPU kernels, built and on for a test module."""

from __future__ import annotations

import pytest

from radixlm.kernels.cpu_ops import fused_ops


@pytest.fixture(scope="module")
def kernels():
    """The built kernels (this machine has a compiler: a failure to build fails here)."""
    was_on = fused_ops.active() is not None
    assert fused_ops.enable(), "the fused CPU kernels did not build"
    yield fused_ops.active()
    if not was_on:
        fused_ops.disable()
