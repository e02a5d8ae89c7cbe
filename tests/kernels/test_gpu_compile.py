"""Every Triton kernel compiles for NVIDIA GPUs (sm_80, sm_86, sm_89, sm_90) within each
target's shared memory, at the tiles ``tile_plan`` chooses for it, on a machine without
one: ``gpu_compile_check.py`` runs in a subprocess without the interpreter.

The default run compiles for sm_86 in bfloat16 (the tightest shared memory, 99 KiB, where
MLA prefill's old tiles did not fit) at SmolLM2's, DeepSeek's MLA and the MoE's shapes; the
other targets, float32 and Llama-8B's heads run with the slow tests, and so does the check
refusing the tiles the wrappers used before they were planned.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]

KERNELS = {
    "_store_kv_kernel", "_extend_attention_kernel", "_decode_split_kernel",
    "_merge_splits_kernel", "_mla_decode_split_kernel", "_gate_up_silu_kernel",
    "_down_weighted_kernel",
}
SCRIPT = Path(__file__).with_name("gpu_compile_check.py")


def run_check(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True,
                          text=True, timeout=600)


def compiled_kernels(stdout: str) -> set[str]:
    return {line.split()[1] for line in stdout.splitlines() if line.startswith("compiled ")}


@pytest.mark.parametrize("arch, dtype", [
    (86, "bfloat16"),
    *[pytest.param(arch, "bfloat16", marks=pytest.mark.slow) for arch in (80, 89, 90)],
    *[pytest.param(arch, "float32", marks=pytest.mark.slow) for arch in (80, 86, 89, 90)],
])
def test_every_kernel_compiles_within_the_targets_shared_memory(arch, dtype):
    # the default run leaves out Llama-8B's heads (the kernels SmolLM2's compile, wider)
    shapes = () if arch != 86 or dtype != "bfloat16" else ("--shapes", "default", "mla", "moe")
    done = run_check(dtype, "--arch", str(arch), *shapes)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert compiled_kernels(done.stdout) == KERNELS
    refused = [line for line in done.stdout.splitlines() if line.startswith("refused")]
    # Only float32 MLA prefill may be refused, and only where 16 x 16 tiles overflow.
    assert len(refused) == (dtype == "float32" and arch in (86, 89)), refused


@pytest.mark.slow
def test_the_check_fails_mla_prefill_at_its_unplanned_tiles_on_sm86():
    done = run_check("bfloat16", "--arch", "86", "--unplanned", "--shapes", "mla")
    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-4000:]
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and "_extend_attention_kernel sm_86: 131072 bytes" in failed[0]
