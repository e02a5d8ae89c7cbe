"""Every Triton kernel compiles for a Hopper GPU (sm_90, bf16 and float32), on a machine
without one: ``gpu_compile_check.py`` runs in a subprocess without the interpreter."""

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

KERNELS = [
    "_store_kv_kernel", "_extend_attention_kernel", "_decode_split_kernel",
    "_merge_splits_kernel", "_mla_decode_split_kernel", "_gate_up_silu_kernel",
    "_down_weighted_kernel",
]


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float32", marks=pytest.mark.slow)])
def test_every_kernel_compiles_for_sm90_within_its_shared_memory(dtype):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    script = Path(__file__).with_name("gpu_compile_check.py")
    done = subprocess.run(
        [sys.executable, str(script), dtype], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    compiled = {line.split()[1] for line in done.stdout.splitlines()
                if line.startswith("compiled ")}
    assert compiled == set(KERNELS)
