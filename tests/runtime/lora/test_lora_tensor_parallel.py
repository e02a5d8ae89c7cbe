"""LoRA adapters under tensor parallelism (issue 61): a model split over 2 ranks (gloo, on
the CPU) with a batch mixing adapters and the base model serves what transformers + peft
serve (greedy tokens equal; logprobs within 1e-4 plus 1e-4 relative, the split's own
drift), with its KV heads split or replicated; adapters loaded at run time and more
adapters than slots reach the other rank, which loads each into the slot rank 0 chose."""

from __future__ import annotations

import pytest
import torch
from lora_adapters import (
    ALL,
    random_prompts,
    reference_greedy_logprobs,
    write_peft_adapter,
)

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
# Adapters on every projection kind: the column-parallel ones (q|k|v, gate|up: each rank
# its rows of B) and the row-parallel ones (o, down: each rank its columns of A).
ADAPTER_CONFIGS = {
    "all4": dict(r=4, lora_alpha=8, target_modules=ALL),
    "qkv2": dict(r=2, lora_alpha=4, target_modules=["q_proj", "k_proj", "v_proj"]),
    "od3rs": dict(r=3, lora_alpha=6, target_modules=["o_proj", "down_proj"], use_rslora=True),
}

pytestmark = pytest.mark.slow  # (two ranks a test: CI's last stage)


@pytest.fixture(scope="module")
def adapters_for(tiny_model_dir, tmp_path_factory):
    """kv layout -> {name: directory} of the adapters over the tiny Llama of that layout."""
    made = {}

    def make(kv: str) -> dict:
        if kv not in made:
            root = tmp_path_factory.mktemp(f"tp-lora-{kv}")
            model_dir = tiny_model_dir("LlamaForCausalLM", kv)
            made[kv] = {name: write_peft_adapter(model_dir, root / name, seed=30 + i, **config)
                        for i, (name, config) in enumerate(ADAPTER_CONFIGS.items())}
        return made[kv]

    return make


def assert_equals_peft(model_dir, adapters, prompts, names, outs) -> None:
    for prompt, name, out in zip(prompts, names, outs, strict=True):
        tokens, logprobs = reference_greedy_logprobs(
            model_dir, adapters[name] if name else None, prompt, GREEDY["max_new_tokens"])
        assert out["output_ids"] == tokens, (name, prompt)
        got = [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(logprobs),
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kv", ["gqa", "mqa"])  # KV heads split between the ranks, replicated
def test_two_ranks_serve_a_mixed_batch_as_peft_does(engine_for, tiny_model_dir, adapters_for,
                                                    kv):
    adapters = adapters_for(kv)
    engine = engine_for("LlamaForCausalLM", kv, tp_size=2, max_loras_per_batch=4,
                        lora_paths=tuple(f"{n}={p}" for n, p in adapters.items()))
    prompts = random_prompts(8, seed=7)
    names = [[*ADAPTER_CONFIGS, None][i % 4] for i in range(len(prompts))]
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=names,
                           return_logprob=True)
    assert_equals_peft(tiny_model_dir("LlamaForCausalLM", kv), adapters, prompts, names, outs)


def test_adapters_loaded_at_run_time_and_swapped_through_slots_reach_the_other_rank(
        engine_for, tiny_model_dir, adapters_for):
    """One slot, three adapters loaded after start-up, each request on another: every
    request has rank 0 place its adapter in the slot the last one held."""
    adapters = adapters_for("gqa")
    engine = engine_for("LlamaForCausalLM", "gqa", tp_size=2, enable_lora=True,
                        max_loras_per_batch=1, max_lora_rank=8)
    for name, path in adapters.items():
        engine.load_lora_adapter(name, str(path))
    prompts = random_prompts(6, seed=8)
    names = [list(ADAPTER_CONFIGS)[i % 3] for i in range(len(prompts))]
    outs = [engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path=name,
                            return_logprob=True) for prompt, name in zip(prompts, names)]
    assert_equals_peft(tiny_model_dir("LlamaForCausalLM", "gqa"), adapters, prompts, names,
                       outs)
    engine.unload_lora_adapter("all4")
    with pytest.raises(ValueError, match="all4"):
        engine.generate(input_ids=prompts[0], sampling_params=GREEDY, lora_path="all4")
    again = engine.generate(input_ids=prompts[1], sampling_params=GREEDY, lora_path="qkv2",
                            return_logprob=True)
    assert again["output_ids"] == outs[1]["output_ids"]
