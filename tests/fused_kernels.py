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


def build_alone(request, builds: dict, source_name: str, bindings: str,
                also: tuple[str, ...] = ()):
    """Yields ``source_name`` (and the sources named in ``also``, which it calls) compiled
    alone with ``bindings`` (a C++ source binding its functions) for the build
    ``request.param`` names in ``builds`` (name -> (the CPU flags it needs, its compiler
    flags)), in a directory removed afterwards; skips where this CPU cannot run that build or
    the tools to build it are missing. (For a module fixture parametrized over ``builds``:
    ``yield from build_alone(...)``.)"""
    import tempfile
    from pathlib import Path

    from torch.utils.cpp_extension import load

    needs, flags = builds[request.param]
    missing = needs - set(fused_ops._cpu_flags())
    if missing:
        pytest.skip(f"this CPU cannot run a {request.param} build (no {sorted(missing)})")
    missing_tool = fused_ops._missing_tool()
    if missing_tool is not None:
        pytest.skip(f"the kernels cannot be built here: {missing_tool}")
    source, *others = (next(path for path in fused_ops.SOURCES if path.name == name)
                       for name in (source_name, *also))
    stem = source_name.removesuffix(".cpp")
    with tempfile.TemporaryDirectory() as directory:
        binding_file = Path(directory) / f"{stem}_bindings.cpp"
        binding_file.write_text(bindings)
        yield load(name=f"{stem}_{request.param.replace('-', '_')}",
                   sources=[str(source), *map(str, others), str(binding_file)],
                   extra_cflags=["-O3", "-fopenmp", *flags], extra_ldflags=["-fopenmp"],
                   extra_include_paths=[str(source.parent)], build_directory=directory)
