"""benchmarks/bench_gpu_decode.py's ``--smoke`` path: the GPU benchmark's code, on a CPU.

The script is meant to run once, unchanged, on a GPU machine; this runs every part of it
(copy, each backend's decode attention on both page sizes, Engines with and without CUDA
graphs) on tiny shapes with Triton interpreted, and checks the tables and the JSON line.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.triton,
    pytest.mark.slow,  # the whole benchmark, interpreted: CI's last stage
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "bench_gpu_decode.py"
ATTENTION_HEADER = "backend       page  plan ms  ms/call  KV GB/s of copy max|out|"
DECODE_HEADER = "backend     batch graphs tok/s eager tok/s  ratio"


def test_smoke_run_prints_every_table_and_a_json_report():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert any(line.startswith("copy 16 MiB device to device") for line in lines)
    for header in ATTENTION_HEADER, DECODE_HEADER:
        assert any(line.startswith(header) for line in lines), done.stdout
    assert "FAILED" not in done.stdout, done.stdout

    report = json.loads(lines[-1])
    attention = {(r["backend"], r["page_size"]): r for r in report["attention"]}
    assert set(attention) == {(b, p) for b in ("torch_native", "triton") for p in (1, 16)}
    assert all(r["max_abs_diff_vs_torch_native"] < 1e-4 for r in attention.values())
    assert all(r["max_abs_diff_vs_triton"] < 1e-4 for r in attention.values())
    decode = {(r["backend"], r["batch"]): r for r in report["decode"]}
    assert set(decode) == {("triton", 1), ("triton", 2)}
    assert all(r["graphs_tok_s"] > 0 and r["eager_tok_s"] > 0 for r in decode.values())


def test_without_cuda_or_smoke_it_exits_with_status_2():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the script would run the real benchmark")
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "needs a CUDA GPU" in done.stderr
