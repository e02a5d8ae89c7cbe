"""Gemma's sandwich layers' decode step as one call of the fused CPU kernels
(``sandwich_decode_layers``) gives the hidden states, logits and stored KV of the module path
to the bit: Gemma 2 (soft-capped attention) and Gemma 3 (q/k norms, a RoPE table per layer
kind), bfloat16 and float32, prompts longer than the window, over the hybrid pool (sliding
layers under its slot map) and the plain one, with LoRA adapters; and it runs where, and
only where, the layers and the step allow it."""

from __future__ import annotations

import pytest
import torch
from fused_decode_checks import (
    DECODE_STEPS,
    assert_sandwich_equals_modules,
    count_sandwich_runs,
    generate,
    make_gemma_runner,
)
from fused_kernels import enable_or_skip
from lora_adapters import ALL, write_raw_adapter
from tiny_models import WINDOW

from radixlm.kernels.cpu_ops import fused_ops
from radixlm.kv_cache.hybrid_pool import HybridKVPool
from radixlm.kv_cache.memory_pool import MHATokenToKVPool
from radixlm.models.gemma import FULL, SLIDING
from radixlm.runtime.device_choice import cpu_has_native_bf16
from radixlm.runtime.model_executor import kv_pool_layout
from radixlm.runtime.model_executor.cpu_decode_runner import (
    CpuDecodeRunner,
    fused_sandwich_stack,
    sandwich_parts,
)

GEMMAS = ["Gemma2ForCausalLM", "Gemma3ForCausalLM"]
PAST_THE_WINDOW = [[3, 9, 4, 11, 7], [5, 2, 8] * 8, [12, 6] * 21]  # 5, 24 and 42 tokens


@pytest.fixture(scope="module")
def kernels_on():
    enable_or_skip()


def dtypes() -> list[str]:
    return ["float32", "bfloat16"] if cpu_has_native_bf16() else ["float32"]


@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("architecture", GEMMAS)
def test_fused_steps_equal_the_modules_over_the_hybrid_pool(
    kernels_on, tiny_model_dir, monkeypatch, architecture, dtype
):
    assert max(map(len, PAST_THE_WINDOW)) > WINDOW + DECODE_STEPS
    runner = assert_sandwich_equals_modules(tiny_model_dir(architecture, "gqa", True),
                                            monkeypatch, PAST_THE_WINDOW, dtype=dtype)
    assert type(runner.kv_pool) is HybridKVPool


@pytest.mark.parametrize("architecture", GEMMAS)
def test_fused_steps_equal_the_modules_over_the_plain_pool(
    kernels_on, tiny_model_dir, monkeypatch, architecture
):
    monkeypatch.setattr(kv_pool_layout, "plain_pool_reason", lambda *args: "this test's")
    runner = assert_sandwich_equals_modules(tiny_model_dir(architecture, "mqa", False),
                                            monkeypatch, PAST_THE_WINDOW, dtype=dtypes()[-1])
    assert type(runner.kv_pool) is MHATokenToKVPool


def test_fused_steps_add_each_requests_lora_adapter_as_the_modules_do(
    kernels_on, tiny_model_dir, monkeypatch, tmp_path
):
    """Two adapters (every projection; the MLP's) and a request of none in one batch."""
    every = write_raw_adapter(tmp_path / "all", seed=1, rank=4, targets=tuple(ALL))
    mlp = write_raw_adapter(tmp_path / "mlp", seed=2, rank=2,
                            targets=("gate_proj", "up_proj", "down_proj"))
    paths = [f"all={every}", f"mlp={mlp}"]
    adapters = ["all", None, "mlp"]
    runner = assert_sandwich_equals_modules(
        tiny_model_dir("Gemma3ForCausalLM", "gqa", True), monkeypatch, PAST_THE_WINDOW,
        adapters=adapters, dtype=dtypes()[-1], enable_lora=True, lora_paths=paths,
        max_loras_per_batch=2, max_lora_rank=8)
    adapted, _ = generate(runner, PAST_THE_WINDOW, adapters)
    plain, _ = generate(runner, PAST_THE_WINDOW)
    changed = [not torch.equal(a, b) for a, b in zip(adapted[0], plain[0])]  # first step's
    assert changed == [True, False, True]


@pytest.mark.parametrize("architecture", GEMMAS)
def test_the_runner_holds_every_gemma_layer_in_one_sandwich_stack(tiny_model_dir,
                                                                  architecture):
    runner = make_gemma_runner(tiny_model_dir(architecture, "gqa", True), dtype="float32")
    decode = runner.cpu_decode_runner
    assert decode.layers == [None, None] and decode.stack is None
    stack = decode.sandwich
    assert [layer.rope_kind for layer in stack.layers] == [SLIDING, FULL]
    assert [len(layer.norms) for layer in stack.layers] == (
        [6, 6] if architecture == "Gemma3ForCausalLM" else [4, 4])
    assert stack.scale == 24**-0.5  # query_pre_attn_scalar's, not the head dim's


def test_a_step_whose_norms_are_not_of_its_dtype_runs_the_modules(
    kernels_on, tiny_model_dir, monkeypatch
):
    """The module's norm takes torch's path there; the fused step declines, every step."""
    runs = count_sandwich_runs(monkeypatch)
    runner = make_gemma_runner(tiny_model_dir("Gemma3ForCausalLM", "gqa", True),
                               dtype="float32")
    norm = runner.model.layers[1].self_attn.k_norm
    norm.weight = torch.nn.Parameter(norm.weight.detach().double(), requires_grad=False)
    generate(runner)
    assert runs == {"fused": 0, "declined": DECODE_STEPS}


def test_kernels_off_run_the_modules(kernels_on, tiny_model_dir, monkeypatch):
    runs = count_sandwich_runs(monkeypatch)
    runner = make_gemma_runner(tiny_model_dir("Gemma2ForCausalLM", "gqa", True),
                               dtype="float32")
    monkeypatch.setattr(fused_ops, "for_tensor", lambda tensor: None)
    generate(runner)
    assert runs == {"fused": 0, "declined": DECODE_STEPS}


@pytest.mark.parametrize("change", ["silu gate", "biased projection", "other eps"])
def test_layers_the_kernels_do_not_serve_build_no_stack(tiny_model_dir, change):
    runner = make_gemma_runner(tiny_model_dir("Gemma3ForCausalLM", "gqa", True),
                               dtype="float32")
    model, layer = runner.model, runner.model.layers[1]
    if change == "silu gate":
        layer.mlp.activation = "silu"
        assert sandwich_parts(layer) is None
    elif change == "biased projection":
        layer.self_attn.o_proj.bias = torch.nn.Parameter(torch.zeros(model.config.hidden_size))
    else:
        layer.post_feedforward_layernorm.eps = 1e-5
    assert fused_sandwich_stack(model) is None
    assert CpuDecodeRunner.build(model) is None


def test_the_kernel_names_operands_of_the_wrong_count(kernels_on):
    kernels = fused_ops.active()
    x = torch.zeros(1, 8)
    with pytest.raises(RuntimeError, match="per layer: six norms"):
        kernels.sandwich_decode_layers(
            x, [x[0]] * 5, 1e-6, [0] * 4, [x] * 4, [x] * 4, [x] * 2, [x] * 2, [x] * 3, [0.0],
            1, 1, 1.0, True, "tanh", [], [], [])
    with pytest.raises(RuntimeError, match="gelu_approximate"):
        kernels.sandwich_decode_layers(
            x, [x[0]] * 6, 1e-6, [0] * 4, [x] * 4, [x] * 4, [x] * 2, [x] * 2, [x] * 3, [0.0],
            1, 1, 1.0, True, "erf", [], [], [])
