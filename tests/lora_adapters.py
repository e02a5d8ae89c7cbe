"""LoRA adapters for the tests: written by ``peft`` (or by hand, quickly, in PEFT's layout)
over the tiny models of ``tiny_models``, and transformers + peft as their reference.

``write_peft_adapter`` makes a real PEFT adapter with random non-zero A and B
(``init_lora_weights=False``); ``write_raw_adapter`` writes the same files without building
a model (for tests that need a hundred). ``peft_reference`` loads an adapter directory back
with ``PeftModel.from_pretrained`` over a private copy of the base model (the base from
``reference_model`` is cached and shared, so it is never wrapped in place).
"""

from __future__ import annotations

import copy
import functools
import json
import random
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import save_file
from tiny_models import reference_model

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
ALL = ATTENTION + MLP
# (out, in) of each projection of the tiny models (hidden 64, 4 heads of 16, 2 KV heads of
# the "gqa" kind, intermediate 128)
TINY_SHAPES = {"q_proj": (64, 64), "k_proj": (32, 64), "v_proj": (32, 64),
               "o_proj": (64, 64), "gate_proj": (128, 64), "up_proj": (128, 64),
               "down_proj": (64, 128)}


def write_peft_adapter(model_dir: Path, out_dir: Path, seed: int, **lora: object) -> Path:
    """A PEFT LoRA adapter of the model at ``model_dir`` with random A and B, saved (as
    safetensors) in ``out_dir``; ``lora``: ``LoraConfig`` fields (r, lora_alpha,
    target_modules, use_rslora, rank_pattern, alpha_pattern ...)."""
    torch.manual_seed(seed)
    config = LoraConfig(init_lora_weights=False, task_type="CAUSAL_LM", **lora)
    model = get_peft_model(copy.deepcopy(reference_model(model_dir)), config)
    model.save_pretrained(out_dir)
    return out_dir


def write_raw_adapter(out_dir: Path, seed: int, rank: int = 1, alpha: float = 2.0,
                      targets: tuple[str, ...] = ("q_proj", "v_proj"), num_layers: int = 2,
                      shapes: dict[str, tuple[int, int]] = TINY_SHAPES) -> Path:
    """A PEFT-layout adapter written directly (no model built): A and B of ``targets`` drawn
    from a seeded normal, scaled so that the adapter changes the tiny model's outputs."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for name in targets:
            out_features, in_features = shapes[name]
            block = "self_attn" if name in ATTENTION else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = 0.3 * torch.randn(
                rank, in_features, generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = 0.3 * torch.randn(
                out_features, rank, generator=generator)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    write_config(out_dir, r=rank, lora_alpha=alpha, target_modules=list(targets))
    return out_dir


def write_config(out_dir: Path, **fields: object) -> None:
    """Writes ``adapter_config.json``: a LoRA config of ``fields`` over PEFT's defaults."""
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 8,
              "lora_dropout": 0.0, "bias": "none", "use_rslora": False, "use_dora": False,
              "fan_in_fan_out": False, "modules_to_save": None, "target_modules": ["q_proj"],
              "base_model_name_or_path": None, **fields}
    (Path(out_dir) / "adapter_config.json").write_text(json.dumps(config))


@functools.lru_cache(maxsize=32)
def peft_reference(model_dir: Path, adapter_dir: Path | None) -> torch.nn.Module:
    """transformers + peft over the adapter at ``adapter_dir`` (None: the base model)."""
    base = reference_model(model_dir)
    if adapter_dir is None:
        return base
    return PeftModel.from_pretrained(copy.deepcopy(base), str(adapter_dir)).eval()


def reference_greedy_logprobs(model_dir: Path, adapter_dir: Path | None, input_ids: list[int],
                              num_tokens: int) -> tuple[list[int], list[float]]:
    """The reference's greedy tokens and their logprobs (each pass over the whole
    sequence: no KV cache to get wrong)."""
    return _greedy(model_dir, adapter_dir, tuple(input_ids), num_tokens)


@functools.lru_cache(maxsize=4096)
@torch.inference_mode()
def _greedy(model_dir: Path, adapter_dir: Path | None, input_ids: tuple[int, ...],
            num_tokens: int) -> tuple[list[int], list[float]]:
    model = peft_reference(model_dir, adapter_dir)
    ids, logprobs = list(input_ids), []
    for _ in range(num_tokens):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        token = int(logits.argmax())
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        ids.append(token)
    return ids[len(input_ids):], logprobs


@torch.inference_mode()
def reference_prompt_logprobs(model_dir: Path, adapter_dir: Path | None,
                              input_ids: list[int]) -> list[float]:
    """log p(token_i | tokens_<i) for i >= 1 under the reference."""
    logits = peft_reference(model_dir, adapter_dir)(input_ids=torch.tensor([input_ids]))
    logprobs = torch.log_softmax(logits.logits[0].float(), -1)
    return logprobs[:-1].gather(1, torch.tensor(input_ids[1:])[:, None])[:, 0].tolist()


def random_prompts(count: int, seed: int, low: int = 5, high: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randint(low, high))]
            for _ in range(count)]


def assert_matches_reference(model_dir: Path, adapters: dict[str, Path | None],
                             prompts: list[list[int]], names: list[str | None],
                             outs: list[dict], num_tokens: int) -> None:
    """Each output equals the reference of its adapter (``adapters``: name -> directory)
    token for token, its logprobs (where returned) within 1e-4."""
    assert len(outs) == len(prompts) == len(names)
    for prompt, name, out in zip(prompts, names, outs):
        tokens, logprobs = reference_greedy_logprobs(
            model_dir, adapters[name] if name else None, prompt, num_tokens)
        assert out["output_ids"] == tokens, (name, prompt)
        entries = out["meta_info"].get("output_token_logprobs")
        if entries:
            assert [entry[1] for entry in entries] == tokens
            torch.testing.assert_close(torch.tensor([entry[0] for entry in entries]),
                                       torch.tensor(logprobs), atol=1e-4, rtol=0)
