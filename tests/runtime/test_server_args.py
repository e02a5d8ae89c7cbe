"""Tests for radixlm/runtime/server_args.py: the dtype choice and its warning by CPU kind;
the weight-only formats it accepts."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
import torch

from radixlm.cli import add_server_options
from radixlm.runtime.device_choice import cpu_has_native_bf16
from radixlm.runtime.server_args import ServerArgs


def test_float32_never_warns_and_bfloat16_warns_only_without_native_bf16():
    assert ServerArgs(dtype="float32", device="cpu").dtype_warning() is None
    assert ServerArgs(dtype="auto", device="cpu").dtype_warning() is None
    warning = ServerArgs(dtype="bfloat16", device="cpu").dtype_warning()
    assert (warning is None) == cpu_has_native_bf16()


def test_auto_dtype_is_bfloat16_only_with_native_bf16():
    expected = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert ServerArgs(dtype="auto", device="cpu").resolved_dtype() == expected


def test_a_cpu_held_to_avx2_gets_float32_and_a_bfloat16_warning():
    """``ATEN_CPU_CAPABILITY=avx2`` makes torch run its AVX2 kernels, as on a CPU without
    AVX-512: there bf16 is emulated, so ``auto`` must not pick it and asking for it warns."""
    probe = (
        "from radixlm.runtime.server_args import ServerArgs\n"
        "print(ServerArgs(device='cpu').resolved_dtype())\n"
        "print(ServerArgs(dtype='bfloat16', device='cpu').dtype_warning())\n"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                            text=True, timeout=120, check=True)
    dtype, warning = result.stdout.splitlines()
    assert dtype == "torch.float32"
    assert "dtype=bfloat16" in warning and "slow" in warning


@pytest.mark.parametrize("dtype", ["bogus", "fp8"])
def test_an_unknown_dtype_is_refused_by_name(dtype):
    with pytest.raises(ValueError, match="dtype"):
        ServerArgs(dtype=dtype)


@pytest.mark.parametrize("quantization", ["fp16wo", "int8wo", None])
def test_the_weight_only_formats_are_accepted_on_a_cpu(quantization):
    assert ServerArgs(quantization=quantization, device="cpu").quantization == quantization


@pytest.mark.parametrize(("options", "words"), [
    ({"quantization": "int4"}, "quantization must be one of"),
    ({"quantization": "awq", "device": "cpu"}, "'awq'"),
    ({"quantization": "int8wo", "device": "cuda"}, "CPU weight format"),
])
def test_an_unknown_or_misplaced_weight_format_is_refused_by_name(options, words):
    with pytest.raises(ValueError, match=words):
        ServerArgs(**options)


def test_overlap_scheduling_is_on_for_gpus_and_asked_for_on_cpus():
    """Unset, ``disable_overlap_schedule`` means overlap on CUDA and the plain loop on a CPU
    (whose cores the forward pass already uses); either way an explicit value wins, and
    ``--disable-overlap-schedule`` stays a bare switch, as in SGLang."""
    assert not ServerArgs("m", device="cpu").overlap_schedule()
    assert ServerArgs("m", device="cuda").overlap_schedule()
    assert ServerArgs("m", device="cpu", disable_overlap_schedule=False).overlap_schedule()
    assert not ServerArgs("m", device="cuda", disable_overlap_schedule=True).overlap_schedule()
    parser = argparse.ArgumentParser()
    add_server_options(parser)
    assert parser.parse_args([]).disable_overlap_schedule is None
    assert parser.parse_args(["--disable-overlap-schedule"]).disable_overlap_schedule is True
