"""A real tmpfs for the tests of failing filesystems (a full or read-only disk): mounted
for a test, unmounted afterwards whatever happens; the test skips where mounting is not
permitted (root here; not everywhere CI runs)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(directory: Path, size: str):
    """A tmpfs of ``size`` (mount's syntax: "16k") at ``directory``, made if needed."""
    directory.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip("no mount command here")
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                             str(directory)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {result.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], capture_output=True, check=False)
