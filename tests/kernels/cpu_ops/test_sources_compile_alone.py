"""Each source of the fused CPU kernels compiles on its own (what it uses from another file
comes through a header), so that a compiler, clangd or a sanitizer can work on it alone: a
syntax-only compile per file, with torch's include paths and the build's flags and defines."""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig

import pytest
from torch.utils.cpp_extension import include_paths

from radixlm.kernels.cpu_ops import fused_ops


@pytest.mark.parametrize("source", fused_ops.SOURCES, ids=lambda source: source.name)
def test_a_kernel_source_compiles_on_its_own(source):
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler ({compiler!r} not found)")
    includes = [f"-I{path}" for path in [*include_paths(), sysconfig.get_paths()["include"]]]
    command = [compiler, "-fsyntax-only", "-std=c++17", *fused_ops.COMPILER_FLAGS,
               *fused_ops.compile_defines(), "-DTORCH_EXTENSION_NAME=radixlm_syntax_check",
               *includes, str(source)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"{source.name} does not compile alone:\n{run.stderr[-4000:]}"
