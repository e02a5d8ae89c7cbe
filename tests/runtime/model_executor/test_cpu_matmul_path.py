"""One-row half-precision passes on CPUs skip oneDNN for torch's matrix-vector kernel unless
the weights are in oneDNN's layout: the switch applies only where it should, gives the same
products and is always restored. A bfloat16 runner gives the fused kernels their own copies
of its weights unless told not to. Float32 one-row passes take the kernel measured faster,
measured once a process, unless adaptive timing is off. All of it lands in the runner's
``CpuExecutionPlan``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fused_kernels import enable_or_skip

from radixlm.kernels.cpu_ops import fused_ops
from radixlm.kernels.cpu_ops.execution_plan import (
    FLOAT32_FUSED_ROWS,
    FLOAT32_FUSED_ROWS_FROM_ONE,
    CpuExecutionPlan,
)
from radixlm.models.layers.cpu_weight_layout import (
    BlockedWeight,
    PairedWeight,
    uses_blocked_layout,
)
from radixlm.models.layers.linear import Linear
from radixlm.models.model_config import ModelConfig
from radixlm.runtime.model_executor import cpu_matmul_path
from radixlm.runtime.model_executor.cpu_matmul_path import (
    build_cpu_plan,
    choose_float32_matrix_vector,
    uses_matrix_vector_path,
)
from radixlm.runtime.model_executor.model_runner import ModelRunner
from radixlm.runtime.server_args import ServerArgs

CPU = torch.device("cpu")


def test_only_half_precision_passes_on_a_cpu_take_the_path():
    has_onednn = torch.backends.mkldnn.is_available()
    assert uses_matrix_vector_path(CPU, torch.bfloat16, "int8wo") == has_onednn
    assert uses_matrix_vector_path(CPU, torch.float16) == has_onednn
    assert not uses_matrix_vector_path(CPU, torch.float32)
    assert not uses_matrix_vector_path(torch.device("meta"), torch.bfloat16)


def test_weights_in_onednns_layout_take_onednn_for_one_row_too():
    laid_out = uses_blocked_layout(CPU, torch.bfloat16)
    assert uses_matrix_vector_path(CPU, torch.bfloat16) == (
        torch.backends.mkldnn.is_available() and not laid_out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_row_times_a_weight_is_the_same_either_way(dtype):
    torch.manual_seed(0)
    weight = (torch.randn(384, 256) * 0.05).to(dtype)
    x = torch.randn(1, 256).to(dtype)
    default = F.linear(x, weight)
    with CpuExecutionPlan(one_row_bypass=True).pass_scope(1, prompt=False):
        assert torch.backends.mkldnn.enabled != torch.backends.mkldnn.is_available()
        bypassed = F.linear(x, weight)
    assert torch.backends.mkldnn.enabled  # restored
    torch.testing.assert_close(bypassed.float(), default.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(bypassed.float(), x.float() @ weight.float().T, atol=2e-2, rtol=2e-2)


def test_the_setting_is_restored_even_when_the_pass_fails():
    before = torch.backends.mkldnn.enabled
    plan = CpuExecutionPlan(one_row_bypass=True)
    with pytest.raises(RuntimeError, match="boom"), plan.pass_scope(1, prompt=True):
        assert plan.prompt_pass and not torch.backends.mkldnn.enabled
        raise RuntimeError("boom")
    assert torch.backends.mkldnn.enabled == before and not plan.prompt_pass
    with plan.pass_scope(2, prompt=False):  # two rows: no bypass
        assert torch.backends.mkldnn.enabled == before
    with CpuExecutionPlan().pass_scope(1, prompt=False):  # no bypass planned
        assert torch.backends.mkldnn.enabled == before


@pytest.mark.skipif(not uses_blocked_layout(CPU, torch.bfloat16),
                    reason="this torch or CPU has no oneDNN bfloat16 matmul")
@pytest.mark.parametrize("drop_rows", [False, True])
def test_a_bfloat16_runner_gives_the_kernels_their_copies_unless_told_not_to(tiny_model_dir,
                                                                             drop_rows):
    """With the fused kernels on, each laid-out weight gets the kernels' own copy: column
    pairs in place of oneDNN's layout where ``pair_matmul`` serves, else plain rows beside
    it for passes of a few rows; ``disable_cpu_weight_rows`` leaves oneDNN's layout alone."""
    path = str(tiny_model_dir("LlamaForCausalLM", "gqa", False))
    args = ServerArgs(path, dtype="bfloat16", max_total_tokens=256,
                      disable_cpu_weight_rows=drop_rows)
    runner = ModelRunner(args, ModelConfig.from_path(path))
    try:
        assert runner.fused_cpu_kernels
        packed = [m.packed for m in runner.model.modules() if isinstance(m, Linear)]
        assert packed
        if not drop_rows and fused_ops.pair_kernels_pay():
            assert all(isinstance(weight, PairedWeight) for weight in packed)
        else:
            assert all(isinstance(weight, BlockedWeight) and (weight.rows is None) == drop_rows
                       for weight in packed)
    finally:
        runner.close()


def test_float32_one_row_passes_take_the_kernel_measured_faster(monkeypatch):
    enable_or_skip()
    monkeypatch.setattr(cpu_matmul_path, "_float32_choice", None)
    timed = []
    real_time = cpu_matmul_path._time_one_row

    def observed(kernels):
        timed.append(real_time(kernels))
        return timed[-1]

    monkeypatch.setattr(cpu_matmul_path, "_time_one_row", observed)
    chosen = choose_float32_matrix_vector()
    assert len(timed) == 1 and all(seconds > 0 for seconds in timed[0])
    torch_s, kernel_s = timed[0]
    assert chosen == (kernel_s < cpu_matmul_path.KERNEL_MARGIN * torch_s)
    assert choose_float32_matrix_vector() == chosen and len(timed) == 1  # once a process
    plan = build_cpu_plan(CPU, torch.float32, None, True, True, measure=True)
    assert plan.float32_fused_rows == (FLOAT32_FUSED_ROWS_FROM_ONE if chosen
                                       else FLOAT32_FUSED_ROWS)
    assert len(timed) == 1


def test_without_adaptive_timing_nothing_is_measured_and_torch_takes_one_row(monkeypatch):
    enable_or_skip()
    monkeypatch.setattr(cpu_matmul_path, "_float32_choice", None)
    monkeypatch.setattr(cpu_matmul_path, "_time_one_row", None)  # not to be called
    plan = build_cpu_plan(CPU, torch.float32, None, True, True, measure=False)
    assert plan.float32_fused_rows == FLOAT32_FUSED_ROWS


def test_the_plan_follows_the_cpu_and_the_options():
    enable_or_skip()
    plan = build_cpu_plan(CPU, torch.bfloat16, None, True, keep_rows=True, measure=False)
    assert plan.pair_kernels == fused_ops.pair_kernels_pay() and plan.keep_rows
    assert plan.one_row_bypass == uses_matrix_vector_path(CPU, torch.bfloat16)
    off = build_cpu_plan(CPU, torch.bfloat16, None, False, keep_rows=True, measure=False)
    assert not off.pair_kernels and not off.keep_rows  # the kernels off: no copies for them
    meta = build_cpu_plan(torch.device("meta"), torch.bfloat16, None, True, True, True)
    assert not (meta.pair_kernels or meta.keep_rows or meta.one_row_bypass)


def test_without_the_kernels_nothing_is_measured(monkeypatch):
    monkeypatch.setattr(cpu_matmul_path, "_float32_choice", None)
    monkeypatch.setattr(cpu_matmul_path, "_time_one_row", None)  # not to be called
    monkeypatch.setattr(fused_ops, "_module", None)
    assert choose_float32_matrix_vector() is False
