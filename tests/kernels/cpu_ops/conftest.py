"""The fused CPU kernels, built and on for a test module."""

from __future__ import annotations

import pytest
from fused_kernels import enable_or_skip

from radixlm.kernels.cpu_ops import fused_ops


@pytest.fixture(scope="module")
def kernels():
    """The built kernels: the module's tests skip where no compiler or ninja is found, and a
    failed build with them fails here."""
    was_on = fused_ops.active() is not None
    yield enable_or_skip()
    if not was_on:
        fused_ops.disable()
