"""The fused CPU kernels for a test: turned on, or the test skipped with the reason they
cannot be built here (``fused_ops.unavailable_reason``: no compiler, no ninja)."""

from __future__ import annotations

from types import ModuleType

import pytest

from radixlm.kernels.cpu_ops import fused_ops


def enable_or_skip() -> ModuleType:
    """Turns the kernels on and returns their module. Where a tool the build needs is
    missing, the calling test skips with the reason; where the tools are there and the build
    fails, it fails (a source that does not compile is a bug, not a missing feature)."""
    if fused_ops.enable():
        return fused_ops.active()
    reason = fused_ops.unavailable_reason()
    if fused_ops._missing_tool() is None:
        pytest.fail(f"the fused CPU kernels did not build: {reason}")
    pytest.skip(f"the fused CPU kernels cannot be built here: {reason}")
