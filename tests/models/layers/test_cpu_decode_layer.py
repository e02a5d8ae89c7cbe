"""A decoder layer's fused decode step (one call of the fused CPU kernels), and all the layers'
steps as one call (the stack), give the hidden states, logits and stored KV of the module
path to the bit, for every weight layout and format they multiply, and run where, and only
where, the layers' parts and the step allow it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from fused_decode_checks import (
    DECODE_STEPS,
    PROMPTS,
    assert_fused_equals_modules,
    count_fused_runs,
    generate,
    make_runner,
    unstacked,
)
from fused_kernels import enable_or_skip
from lora_adapters import ALL, write_raw_adapter

from radixlm.kernels.cpu_ops import fused_ops
from radixlm.kernels.cpu_ops.execution_plan import (
    FLOAT32_FUSED_ROWS_FROM_ONE,
    TORCH_CHOICES,
    CpuExecutionPlan,
)
from radixlm.kernels.cpu_ops.fused_ops import ProjectionKernel
from radixlm.models.layers.cpu_decode_stack import FusedDecodeStack
from radixlm.models.layers.cpu_weight_layout import uses_blocked_layout
from radixlm.models.layers.linear import Linear
from radixlm.models.layers.weight_formats import (
    HALF_FUSED_MAX_ROWS,
    HALF_FUSED_MAX_ROWS_FLOAT32,
    ConversionBuffer,
    HalfWeight,
    Int8Weight,
)
from radixlm.models.layers.weight_storage import BlockedWeight
from radixlm.runtime.device_choice import cpu_has_native_bf16
from radixlm.runtime.model_executor import cpu_matmul_path
from radixlm.runtime.model_executor.cpu_decode_runner import fused_decode_layer

# A batch mixing three LoRA adapters (ranks 2 to 4 below the pool's 8, one on every
# projection, one on q and v, one on the MLP) and a request of none, one adapter's rows apart.
ADAPTER_TARGETS = {"all4": (4, tuple(ALL)), "qv2": (2, ("q_proj", "v_proj")),
                   "mlp3": (3, ("gate_proj", "up_proj", "down_proj"))}
ADAPTED_PROMPTS = [*PROMPTS, [7, 1, 9, 2, 13], [4, 10] * 5]
ADAPTED = ["all4", None, "qv2", "all4", "mlp3"]


@pytest.fixture(scope="module")
def kernels_on():
    enable_or_skip()


@pytest.fixture(scope="module")
def pairs_serve(kernels_on):
    if not fused_ops.pair_kernels_pay():
        pytest.skip("the fused kernels' pair_matmul does not serve on this CPU")


@pytest.fixture
def fused_runs(monkeypatch):
    return count_fused_runs(monkeypatch)


@pytest.mark.parametrize("kv", ["gqa", "mha"])
@pytest.mark.parametrize("stacked", [True, False])
def test_fused_steps_by_pairs_equal_the_module_path_to_the_bit(pairs_serve, tiny_model_dir,
                                                               fused_runs, monkeypatch, kv,
                                                               stacked):
    if not stacked:
        unstacked(monkeypatch)
    used = assert_fused_equals_modules(tiny_model_dir("LlamaForCausalLM", kv, False),
                                       fused_runs, monkeypatch)
    assert used == [ProjectionKernel.PAIRS] * 4
    assert (fused_runs["stacked"] > 0) is stacked


@pytest.mark.parametrize("dtype, quantization, requests, kernel", [
    ("float32", None, 1, ProjectionKernel.TORCH_LINEAR),  # where measured the faster
    ("float32", None, 1, ProjectionKernel.DENSE),  # where measured the faster
    ("float32", None, 3, ProjectionKernel.DENSE),
    ("float32", "int8wo", 3, ProjectionKernel.INT8_BLOCKED),
    ("bfloat16", "int8wo", 1, ProjectionKernel.INT8_PAIRS),  # INT8 without pairs
    ("bfloat16", "fp16wo", 3, ProjectionKernel.DENSE),
    ("float32", "fp16wo", 3, ProjectionKernel.BLOCKED),  # stored as dtype=auto stores it
    ("auto", None, 3, ProjectionKernel.BLOCKED),  # float32 over 16-bit column blocks
])
def test_fused_steps_of_other_formats_equal_the_module_path_to_the_bit(
        kernels_on, tiny_model_dir, fused_runs, monkeypatch, dtype, quantization, requests,
        kernel):
    if dtype == "auto" and cpu_has_native_bf16():
        pytest.skip("dtype=auto computes in bfloat16 here")
    measured = cpu_matmul_path._float32_choice
    if dtype == "float32" and requests == 1:  # as the runner's measurement would choose
        cpu_matmul_path._float32_choice = kernel is ProjectionKernel.DENSE
    try:
        used = assert_fused_equals_modules(
            tiny_model_dir("LlamaForCausalLM", "gqa", False), fused_runs, monkeypatch,
            PROMPTS[-requests:], dtype=dtype, quantization=quantization)
    finally:
        cpu_matmul_path._float32_choice = measured
    if kernel is ProjectionKernel.INT8_PAIRS and not fused_ops.pair_kernels_pay():
        kernel = ProjectionKernel.INT8
    assert used == [kernel] * 4


def test_a_step_with_the_kernels_off_runs_the_modules(kernels_on, tiny_model_dir, fused_runs):
    runner = make_runner(tiny_model_dir("LlamaForCausalLM", "gqa", False))
    fused_ops.disable()
    try:
        generate(runner)
    finally:
        fused_ops.enable()
    assert fused_runs == {"fused": 0, "declined": len(runner.model.layers) * DECODE_STEPS,
                          "stacked": 0}


@pytest.mark.parametrize("architecture", [
    "Qwen2ForCausalLM",  # q/k/v biases
    "Qwen3ForCausalLM",  # q/k norms
])
def test_layers_whose_parts_do_not_allow_it_run_the_modules(kernels_on, tiny_model_dir,
                                                             fused_runs, architecture):
    runner = make_runner(tiny_model_dir(architecture, "gqa", False))
    generate(runner)
    assert fused_runs == {"fused": 0, "declined": 0, "stacked": 0}
    assert all(fused_decode_layer(layer) is None for layer in runner.model.layers)
    assert runner.cpu_decode_runner is None


@pytest.mark.skipif(not uses_blocked_layout("cpu", torch.bfloat16),
                    reason="no oneDNN bfloat16 layout here: bfloat16 rows run the kernels")
def test_steps_whose_products_run_on_onednn_run_the_modules(kernels_on, tiny_model_dir,
                                                            fused_runs):
    runner = make_runner(tiny_model_dir("LlamaForCausalLM", "gqa", False),
                         disable_cpu_weight_rows=True)  # oneDNN's layout, no kept rows
    generate(runner)
    assert runner.cpu_decode_runner.stack is not None  # built, and declines each step
    assert fused_runs == {"fused": 0, "declined": len(runner.model.layers) * DECODE_STEPS,
                          "stacked": 0}


def test_layers_that_differ_in_shape_or_lack_a_fused_step_are_not_stacked(kernels_on,
                                                                          tiny_model_dir):
    runner = make_runner(tiny_model_dir("LlamaForCausalLM", "gqa", False))
    layers = [fused_decode_layer(layer) for layer in runner.model.layers]
    assert len(layers) > 1 and FusedDecodeStack.build(layers) is not None
    assert FusedDecodeStack.build([]) is None
    assert FusedDecodeStack.build([*layers[:-1], None]) is None
    for change in ({"heads": layers[-1].heads * 2}, {"scale": layers[-1].scale / 2}):
        assert FusedDecodeStack.build([*layers[:-1], replace(layers[-1], **change)]) is None


def test_the_stack_gathers_its_operands_anew_when_a_weight_changes(kernels_on, tiny_model_dir):
    runner = make_runner(tiny_model_dir("LlamaForCausalLM", "gqa", False))
    stack = runner.cpu_decode_runner.stack
    first = stack._operands(3, runner.dtype)
    assert first is not None and stack._operands(3, runner.dtype) is first  # kept
    norm = stack.layers[1].post_norm
    norm.weight = torch.nn.Parameter(norm.weight.detach().clone())
    again = stack._operands(3, runner.dtype)
    assert again is not first and again[0][3] is norm.weight  # layer 1's post norm
    norm.weight = torch.nn.Parameter(norm.weight.detach().float())
    assert stack._operands(3, runner.dtype) is None  # a norm not of the rows' dtype


def test_a_projection_names_the_kernel_its_matmul_runs():
    linear = Linear(32, 48, bias=False)
    weight = linear.weight.detach()
    assert linear.plan is TORCH_CHOICES  # no runner planned it: torch's one-row product
    assert linear.fused_projection(1, torch.float32).kernel is ProjectionKernel.TORCH_LINEAR
    linear.plan = CpuExecutionPlan(float32_fused_rows=FLOAT32_FUSED_ROWS_FROM_ONE)
    assert linear.fused_projection(1, torch.float32).kernel is ProjectionKernel.DENSE
    assert linear.fused_projection(3, torch.float32).kernel is ProjectionKernel.DENSE
    assert linear.fused_projection(17, torch.float32).kernel is ProjectionKernel.TORCH_LINEAR
    assert linear.fused_projection(3, torch.bfloat16).kernel is ProjectionKernel.TORCH_LINEAR
    int8 = Int8Weight.pack(weight, ConversionBuffer())
    product = int8.fused_projection(16, torch.bfloat16)
    assert product.kernel is ProjectionKernel.INT8 and product.scales is int8.scales
    assert int8.fused_projection(17, torch.bfloat16) is None  # widened, torch's matmul
    assert int8.fused_projection(32, torch.float32).kernel is ProjectionKernel.INT8
    paired = Int8Weight.pack(weight, ConversionBuffer(), by_pairs=True)
    assert paired.fused_projection(512, torch.bfloat16).kernel is ProjectionKernel.INT8_PAIRS
    assert paired.fused_projection(1, torch.float32) is None  # the pairs take bfloat16 rows
    half = HalfWeight.pack(weight, ConversionBuffer())
    assert half.fused_projection(HALF_FUSED_MAX_ROWS_FLOAT32, torch.float32).weight is half.weight
    assert half.fused_projection(HALF_FUSED_MAX_ROWS_FLOAT32 + 1, torch.float32) is None
    assert half.fused_projection(HALF_FUSED_MAX_ROWS, torch.bfloat16).weight is half.weight
    assert half.fused_projection(HALF_FUSED_MAX_ROWS + 1, torch.bfloat16) is None
    blocked = BlockedWeight.stored_as(weight, torch.bfloat16, ConversionBuffer())
    for rows in (1, 16, 512):  # every length (dtype=auto's float32 passes)
        product = blocked.fused_projection(rows, torch.float32)
        assert product.kernel is ProjectionKernel.BLOCKED and product.weight is blocked.blocks
    assert blocked.fused_projection(1, torch.bfloat16) is None


@pytest.fixture(scope="module")
def lora_options(tmp_path_factory) -> dict:
    """ServerArgs options serving the ADAPTER_TARGETS adapters over the tiny Llama."""
    root = tmp_path_factory.mktemp("decode-lora")
    paths = [f"{name}={write_raw_adapter(root / name, seed=i, rank=rank, targets=targets)}"
             for i, (name, (rank, targets)) in enumerate(ADAPTER_TARGETS.items())]
    return dict(enable_lora=True, lora_paths=paths, max_loras_per_batch=3, max_lora_rank=8)


@pytest.mark.parametrize("dtype, quantization", [
    ("bfloat16", None),  # bfloat16 weights by pairs (forced where they run but do not pay)
    ("bfloat16", "fp16wo"),  # bfloat16 rows (and adapters) over float16 weights: DENSE
    ("float32", None),
])
@pytest.mark.parametrize("stacked", [True, False])
def test_fused_steps_with_adapters_equal_the_module_path_to_the_bit(
        kernels_on, tiny_model_dir, fused_runs, monkeypatch, lora_options, dtype,
        quantization, stacked):
    """Decode steps whose rows use three adapters and none run fused (every layer, no
    declines) and give the module path's hidden states, logits and KV to the bit."""
    if dtype == "bfloat16" and quantization is None and not fused_ops.pair_kernels_pay():
        module = fused_ops.active()
        if not (module.prefill_attention_available() and module.pair_matmul_available()):
            pytest.skip("the fused kernels' pair_matmul is not built here")
        monkeypatch.setattr(fused_ops, "pair_kernels_pay", lambda: True)
    if not stacked:
        unstacked(monkeypatch)
    used = assert_fused_equals_modules(
        tiny_model_dir("LlamaForCausalLM", "gqa", False), fused_runs, monkeypatch,
        ADAPTED_PROMPTS, ADAPTED, dtype=dtype, quantization=quantization, **lora_options)
    assert used == [ProjectionKernel.PAIRS if dtype == "bfloat16" and quantization is None
                    else ProjectionKernel.DENSE] * 4
    assert (fused_runs["stacked"] > 0) is stacked


@pytest.mark.parametrize("stacked", [True, False])
def test_fused_steps_add_each_row_s_adapter_and_leave_rows_of_none_alone(
        kernels_on, tiny_model_dir, fused_runs, monkeypatch, lora_options, stacked):
    """The same fused steps with and without the adapters: every row of an adapter changes
    (its adapter is applied), the row of none keeps its bits."""
    if not stacked:
        unstacked(monkeypatch)
    runner = make_runner(tiny_model_dir("LlamaForCausalLM", "gqa", False), dtype="float32",
                         **lora_options)
    adapted, _ = generate(runner, ADAPTED_PROMPTS, ADAPTED)
    plain, _ = generate(runner, ADAPTED_PROMPTS)
    assert fused_runs["fused"] == 2 * len(runner.model.layers) * DECODE_STEPS
    assert fused_runs["declined"] == 0
    hidden_adapted, hidden_plain = adapted[0], plain[0]  # the first decode step's
    for row, name in enumerate(ADAPTED):
        if name is None:
            assert torch.equal(hidden_adapted[row], hidden_plain[row])
        else:
            assert not torch.allclose(hidden_adapted[row], hidden_plain[row], atol=1e-3), name
