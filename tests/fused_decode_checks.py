"""Checks of the fused CPU decode steps (``models/layers/cpu_decode_layer.py``,
``cpu_decode_stack.py`` and ``cpu_sandwich_decode.py``) against the module path, for the
tests of the layers and of the weight formats and models that run them."""

from __future__ import annotations

import torch

from radixlm.kernels.cpu_ops.fused_ops import ProjectionKernel
from radixlm.kernels.forward_batch import ForwardMode
from radixlm.models.layers.cpu_decode_layer import FusedDecodeLayer
from radixlm.models.layers.cpu_decode_stack import FusedDecodeStack
from radixlm.models.layers.cpu_sandwich_decode import FusedSandwichStack
from radixlm.models.layers.layernorm import GemmaRMSNorm
from radixlm.models.model_config import ModelConfig
from radixlm.runtime.model_executor.model_runner import ModelRunner
from radixlm.runtime.server_args import ServerArgs

PROMPTS = [[3, 9, 4, 11, 7], [5, 2, 8] * 8, [12, 6] * 21]  # 5, 24 and 42 tokens
DECODE_STEPS = 6


def count_fused_runs(monkeypatch) -> dict[str, int]:
    """Counts, by observing the real ``run``s: layer steps that ran fused (alone or in the
    stack), layer steps whose fused run declined, and steps the stack ran."""
    counts = {"fused": 0, "declined": 0, "stacked": 0}
    real_layer_run, real_stack_run = FusedDecodeLayer.run, FusedDecodeStack.run

    def observed_layer(self, *args):
        out = real_layer_run(self, *args)
        counts["fused" if out is not None else "declined"] += 1
        return out

    def observed_stack(self, *args):
        out = real_stack_run(self, *args)
        if out is not None:
            counts["fused"] += len(self.layers)
            counts["stacked"] += 1
        return out

    monkeypatch.setattr(FusedDecodeLayer, "run", observed_layer)
    monkeypatch.setattr(FusedDecodeStack, "run", observed_stack)
    return counts


def unstacked(monkeypatch) -> None:
    """Each layer's fused step runs on its own (no stack is built)."""
    monkeypatch.setattr(FusedDecodeStack, "build", classmethod(lambda cls, layers: None))


def make_runner(path, dtype="bfloat16", **options) -> ModelRunner:
    """A runner whose norms' weights differ from layer to layer and norm to norm (the tiny
    models' are all ones), so that a norm applied in another's place shows."""
    args = ServerArgs(str(path), dtype=dtype, max_total_tokens=512, **options)
    runner = ModelRunner(args, ModelConfig.from_path(str(path)))
    with torch.no_grad():
        for i, layer in enumerate(runner.model.layers):
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            for j, norm in enumerate(norms):
                phase = torch.arange(norm.weight.numel()) + 5 * i + 2 * j
                norm.weight.copy_(1 + 0.5 * torch.sin(phase))
    return runner


def generate(runner: ModelRunner, prompts: list[list[int]] = PROMPTS,
             adapters: list[str | None] | None = None
             ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Prefills ``prompts``, then greedy-decodes DECODE_STEPS steps: each step's hidden
    states and logits, and the slots' KV of every layer at the end. ``adapters``: each
    prompt's LoRA adapter (None: none) in every pass."""
    rows = [runner.req_to_token_pool.alloc() for _ in prompts]
    table = runner.req_to_token_pool.req_to_token
    slots = []
    for row, prompt in zip(rows, prompts):
        slots.append(runner.allocator.alloc(len(prompt)))
        table[row, : len(prompt)] = slots[-1]
    lens = [len(p) for p in prompts]
    batch = runner.make_forward_batch(
        ForwardMode.EXTEND, sum(prompts, []), [i for n in lens for i in range(n)],
        torch.cat(slots), rows, [0] * len(rows), lens)
    if adapters is not None:
        batch.lora = runner.lora.batch_for(adapters, lens)
    hidden = runner.forward(batch)
    last = torch.tensor(lens).cumsum(0) - 1
    tokens = runner.compute_logits(hidden[last]).argmax(-1).tolist()
    steps = []
    for _ in range(DECODE_STEPS):
        new = runner.allocator.alloc(len(rows))
        for row, n, slot in zip(rows, lens, new):
            table[row, n] = slot
        inputs = runner.decode_inputs(tokens, lens, rows)
        batch = runner.make_decode_batch(inputs, new, lens)
        if adapters is not None:
            batch.lora = runner.lora.batch_for(adapters, [1] * len(rows))
        hidden = runner.forward(batch)
        logits = runner.compute_logits(hidden)
        steps += [hidden, logits]
        tokens = logits.argmax(-1).tolist()
        lens = [n + 1 for n in lens]
    used = torch.cat([table[row, :n] for row, n in zip(rows, lens)])
    pool = runner.kv_pool
    kv = []
    for layer in range(len(runner.model.layers)):
        slot_map = pool.slot_map_for(layer)  # a sliding layer's of a hybrid pool
        kv += [buffer[used if slot_map is None else slot_map[used]].clone()
               for buffer in pool.get_kv(layer)]
    return steps, kv


def assert_fused_equals_modules(path, fused_runs, monkeypatch, prompts=PROMPTS,
                                adapters=None, **options) -> list[ProjectionKernel]:
    """Runs the fused and the module path; returns the kernels the fused one multiplied by."""
    runner = make_runner(path, **options)
    layer = runner.model.layers[0]
    projections = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                   layer.mlp.down_proj)
    used = [p.fused_projection(len(prompts), runner.dtype).kernel for p in projections]
    fused_steps, fused_kv = generate(runner, prompts, adapters)
    layers = len(runner.model.layers)
    stacked = runner.cpu_decode_runner.stack is not None
    assert fused_runs == {"fused": layers * DECODE_STEPS, "declined": 0,
                          "stacked": DECODE_STEPS if stacked else 0}
    monkeypatch.setattr(FusedDecodeLayer, "build", classmethod(lambda cls, *args: None))
    module_steps, module_kv = generate(make_runner(path, **options), prompts, adapters)
    assert fused_runs["fused"] == layers * DECODE_STEPS  # no more
    for fused, module in zip(fused_steps + fused_kv, module_steps + module_kv, strict=True):
        assert torch.equal(fused, module)
    return used


def make_gemma_runner(path, dtype="bfloat16", **options) -> ModelRunner:
    """A runner whose every Gemma norm (four a layer, q and k) has weights of its own (the
    tiny models' are all zeros: the identity scale)."""
    args = ServerArgs(str(path), dtype=dtype, max_total_tokens=512, **options)
    runner = ModelRunner(args, ModelConfig.from_path(str(path)))
    norms = [m for m in runner.model.layers.modules() if isinstance(m, GemmaRMSNorm)]
    with torch.no_grad():
        for i, norm in enumerate(norms):
            norm.weight.copy_(0.4 * torch.sin(torch.arange(norm.weight.numel()) + 3 * i))
    return runner


def count_sandwich_runs(monkeypatch) -> dict[str, int]:
    """Counts, by observing the real ``run``: the sandwich stack's steps that ran fused and
    those it declined."""
    runs = {"fused": 0, "declined": 0}
    real_run = FusedSandwichStack.run

    def observed(self, *args):
        out = real_run(self, *args)
        runs["fused" if out is not None else "declined"] += 1
        return out

    monkeypatch.setattr(FusedSandwichStack, "run", observed)
    return runs


def assert_sandwich_equals_modules(path, monkeypatch, prompts=PROMPTS, adapters=None,
                                   **options) -> ModelRunner:
    """Runs a Gemma model's decode steps fused (every step as one sandwich_decode_layers
    call) and on its modules: hidden states, logits and stored KV equal to the bit.
    ``adapters``: each prompt's LoRA adapter, as ``generate`` takes them. Returns the fused
    path's runner."""
    runs = count_sandwich_runs(monkeypatch)
    runner = make_gemma_runner(path, **options)
    assert runner.cpu_decode_runner.sandwich is not None
    fused_steps, fused_kv = generate(runner, prompts, adapters)
    assert runs == {"fused": DECODE_STEPS, "declined": 0}
    monkeypatch.setattr(FusedSandwichStack, "build", classmethod(lambda cls, *args: None))
    modules = make_gemma_runner(path, **options)
    assert modules.cpu_decode_runner is None
    module_steps, module_kv = generate(modules, prompts, adapters)
    assert runs["fused"] == DECODE_STEPS  # no more
    for fused, module in zip(fused_steps + fused_kv, module_steps + module_kv, strict=True):
        assert torch.equal(fused, module)
    return runner
