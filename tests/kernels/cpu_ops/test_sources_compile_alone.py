"""Each source of the fused CPU kernels compiles on its own (what it uses from another file
comes through a header), so that a compiler, clangd or a sanitizer can work on it alone: a
syntax-only compile per file, with torch's include paths and the build's flags and defines.
The files compile side by side (one compiler per core): each parses ATen's headers, which
takes the whole check most of a minute on two cores, so it runs in CI's slow stage (the
default run still builds the kernels from these sources)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

from radixlm.kernels.cpu_ops import fused_ops


def compile_alone(compiler: str, source: Path) -> str | None:
    """Why ``source`` does not compile on its own (the compiler's complaint), or None."""
    includes = [f"-I{path}" for path in [*include_paths(), sysconfig.get_paths()["include"]]]
    command = [compiler, "-fsyntax-only", "-std=c++17", *fused_ops.COMPILER_FLAGS,
               *fused_ops.compile_defines(), "-DTORCH_EXTENSION_NAME=radixlm_syntax_check",
               *includes, str(source)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    return None if run.returncode == 0 else run.stderr[-4000:]


@pytest.mark.slow
def test_every_kernel_source_compiles_on_its_own():
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler ({compiler!r} not found)")
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        complaints = dict(zip(fused_ops.SOURCES,
                              pool.map(lambda source: compile_alone(compiler, source),
                                       fused_ops.SOURCES)))
    failed = {source.name: why for source, why in complaints.items() if why is not None}
    assert not failed, "\n\n".join(f"{name} does not compile alone:\n{why}"
                                   for name, why in failed.items())


def test_a_source_that_needs_another_files_code_is_caught(tmp_path):
    """The check can fail: a file using a helper no header of its own declares."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler ({compiler!r} not found)")
    source = tmp_path / "leaning.cpp"
    source.write_text("#include <cstdint>\nint64_t f() { return helper_of_another_file(); }\n")
    assert "helper_of_another_file" in compile_alone(compiler, source)
