"""A decoder layer's fused decode step (one call of the fused CPU kernels) gives the hidden
states, logits and stored KV of the module path to the bit, and runs where, and only where,
its parts and the step allow it."""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels.cpu_ops import fused_ops
from radixlm.kernels.forward_batch import ForwardMode
from radixlm.models.layers.cpu_decode_layer import FusedDecodeLayer
from radixlm.models.model_config import ModelConfig
from radixlm.runtime.model_executor.model_runner import ModelRunner
from radixlm.runtime.server_args import ServerArgs

PROMPTS = [[3, 9, 4, 11, 7], [5, 2, 8] * 8, [12, 6] * 21]  # 5, 24 and 42 tokens
DECODE_STEPS = 6


@pytest.fixture(scope="module")
def pairs_serve():
    if not fused_ops.enable() or not fused_ops.pair_matmul_serves():
        pytest.skip("the fused kernels' pair_matmul does not serve on this CPU")


@pytest.fixture
def fused_runs(monkeypatch):
    """Counts the layer steps that ran fused (the real ``run``, observed)."""
    counts = {"fused": 0, "declined": 0}
    real_run = FusedDecodeLayer.run

    def observed(self, *args):
        out = real_run(self, *args)
        counts["fused" if out is not None else "declined"] += 1
        return out

    monkeypatch.setattr(FusedDecodeLayer, "run", observed)
    return counts


def make_runner(path, **options) -> ModelRunner:
    args = ServerArgs(str(path), dtype="bfloat16", max_total_tokens=512, **options)
    return ModelRunner(args, ModelConfig.from_path(str(path)))


def generate(runner: ModelRunner) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Prefills PROMPTS, then greedy-decodes DECODE_STEPS steps: each step's hidden states
    and logits, and the slots' KV of every layer at the end."""
    rows = [runner.req_to_token_pool.alloc() for _ in PROMPTS]
    table = runner.req_to_token_pool.req_to_token
    slots = []
    for row, prompt in zip(rows, PROMPTS):
        slots.append(runner.allocator.alloc(len(prompt)))
        table[row, : len(prompt)] = slots[-1]
    lens = [len(p) for p in PROMPTS]
    batch = runner.make_forward_batch(
        ForwardMode.EXTEND, sum(PROMPTS, []), [i for n in lens for i in range(n)],
        torch.cat(slots), rows, [0] * len(rows), lens)
    hidden = runner.forward(batch)
    last = torch.tensor(lens).cumsum(0) - 1
    tokens = runner.compute_logits(hidden[last]).argmax(-1).tolist()
    steps = []
    for _ in range(DECODE_STEPS):
        new = runner.allocator.alloc(len(rows))
        for row, n, slot in zip(rows, lens, new):
            table[row, n] = slot
        inputs = runner.decode_inputs(tokens, lens, rows)
        hidden = runner.forward(runner.make_decode_batch(inputs, new, lens))
        logits = runner.compute_logits(hidden)
        steps += [hidden, logits]
        tokens = logits.argmax(-1).tolist()
        lens = [n + 1 for n in lens]
    used = torch.cat([table[row, :n] for row, n in zip(rows, lens)])
    kv = [buffer[used].clone() for buffer in runner.kv_pool.layer_buffers()]
    return steps, kv


@pytest.mark.parametrize("kv", ["gqa", "mha"])
def test_fused_steps_equal_the_module_path_to_the_bit(pairs_serve, tiny_model_dir, fused_runs,
                                                      monkeypatch, kv):
    path = tiny_model_dir("LlamaForCausalLM", kv, False)
    runner = make_runner(path)
    fused_steps, fused_kv = generate(runner)
    layers = len(runner.model.layers)
    assert fused_runs == {"fused": layers * DECODE_STEPS, "declined": 0}
    monkeypatch.setattr(FusedDecodeLayer, "build", classmethod(lambda cls, *args: None))
    module_steps, module_kv = generate(make_runner(path))
    assert fused_runs["fused"] == layers * DECODE_STEPS  # no more
    for fused, module in zip(fused_steps + fused_kv, module_steps + module_kv, strict=True):
        assert torch.equal(fused, module)


def test_a_step_with_the_kernels_off_runs_the_modules(pairs_serve, tiny_model_dir, fused_runs):
    runner = make_runner(tiny_model_dir("LlamaForCausalLM", "gqa", False))
    fused_ops.disable()
    try:
        generate(runner)
    finally:
        fused_ops.enable()
    assert fused_runs == {"fused": 0, "declined": len(runner.model.layers) * DECODE_STEPS}


@pytest.mark.parametrize("architecture, options", [
    ("Qwen2ForCausalLM", {}),  # q/k/v biases
    ("Qwen3ForCausalLM", {}),  # q/k norms
    ("LlamaForCausalLM", {"disable_cpu_weight_rows": True}),  # oneDNN's layout, not pairs
])
def test_layers_whose_parts_do_not_allow_it_run_the_modules(pairs_serve, tiny_model_dir,
                                                             fused_runs, architecture, options):
    runner = make_runner(tiny_model_dir(architecture, "gqa", False), **options)
    generate(runner)
    assert fused_runs == {"fused": 0, "declined": 0}
    assert all(layer._fused_decode() is None for layer in runner.model.layers)
