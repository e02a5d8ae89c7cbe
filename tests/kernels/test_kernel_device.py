"""Kernel tests hand Triton tensors on ``kernel_device.KERNEL_DEVICE``: the GPU where there is
one (Triton reads only device memory, and ``TRITON_INTERPRET`` is left unset there), the CPU
under the interpreter elsewhere. On a CPU every device is the CPU, so what can be checked
here is that each test module that runs a Triton kernel takes its device from
``kernel_device``; a module that builds CPU tensors of its own would fail on a GPU machine
(issue 58 item 7), and ``benchmarks/gpu_check.sh`` runs these tests there."""

from __future__ import annotations

from pathlib import Path

import pytest

KERNEL_TESTS = Path(__file__).parent
RUNS_TRITON = ("radixlm.kernels.triton_ops", "TritonAttentionBackend")
NO_LAUNCH = {
    "gpu_compile_check.py": "compiles kernels for GPU targets with launches recorded, not run",
    "triton_ops/test_tile_plan.py": "calls a wrapper only to see it refuse before launching",
    "attention/test_triton_engine.py": "its Engine's scheduler process picks the device",
}


def triton_test_modules() -> list[str]:
    return sorted(str(path.relative_to(KERNEL_TESTS)) for path in KERNEL_TESTS.rglob("*.py")
                  if path.name != Path(__file__).name
                  and any(marker in path.read_text() for marker in RUNS_TRITON))


def test_the_triton_test_modules_are_found():
    modules = triton_test_modules()
    assert "triton_ops/test_triton_mla.py" in modules and "test_kernel_device.py" not in modules
    assert set(NO_LAUNCH) <= set(modules), "an exemption names a module that is gone"


@pytest.mark.parametrize("module", [m for m in triton_test_modules() if m not in NO_LAUNCH])
def test_each_module_running_triton_takes_its_device_from_kernel_device(module):
    assert "KERNEL_DEVICE" in (KERNEL_TESTS / module).read_text(), (
        f"tests/kernels/{module} runs Triton kernels: build their inputs on "
        "kernel_device.KERNEL_DEVICE (a CPU tensor reaches a GPU kernel on a GPU machine)")
