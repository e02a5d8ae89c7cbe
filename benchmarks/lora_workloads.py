"""The workload of ``bench_lora.py``: short chat prompts, random PEFT LoRA adapters of the
default model, and full model directories with one adapter merged in.

- ``chat_prompts(n)``: ``n`` distinct one-line questions (tens of tokens in the model's chat
  template), deterministic;
- ``write_adapters``: ``count`` adapters of one PEFT model whose LoRA weights are drawn
  afresh per adapter (seeded by its index), saved with ``save_pretrained``;
- ``write_merged``: the base model with one saved adapter merged in (``merge_and_unload``),
  saved as a full model directory beside the base model's tokenizer files.
"""

from __future__ import annotations

import shutil
from pathlib import Path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOPICS = ("the moon", "a volcano", "bread", "a bicycle", "rain", "chess", "a library",
          "the ocean", "coffee", "a lighthouse", "winter", "a robot", "music", "a river",
          "gardening", "the internet", "a desert", "honey bees", "a train station", "glass",
          "a thunderstorm", "paper", "a market", "the stars", "a bridge", "salt", "clocks",
          "a forest", "maps", "an island", "snow", "a violin")
FORMS = ("Write one sentence about {}.", "Give me a short fact about {}.",
         "Describe {} in a few words.", "What is interesting about {}?",
         "Write a haiku about {}.", "Tell a tiny story about {}.",
         "List three words that remind you of {}.", "Explain {} to a child.")


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    """``n`` chat prompts' ids, as ``Engine.apply_chat_template`` makes the text; distinct for
    ``n <= len(TOPICS) * len(FORMS)`` (256), repeating after that."""
    out = []
    for i in range(n):
        form, topic = FORMS[i % len(FORMS)], TOPICS[(i // len(FORMS)) % len(TOPICS)]
        chat = [{"role": "user", "content": form.format(topic)}]
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def load_base(model_path: str, dtype=None):
    """The base model in float32 (transformers), the reference PEFT wraps."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype or torch.float32)


def write_adapters(model_path: str, out_dir: Path, names: list[str], rank: int, alpha: int,
                   targets: tuple[str, ...] = TARGETS, b_scale: float = 0.1,
                   seed: int = 1000) -> dict[str, Path]:
    """Adapters ``names`` under ``out_dir``: rank ``rank`` on ``targets``,
    ``init_lora_weights=False`` (A and B both random, nn.Linear's init), B then scaled by
    ``b_scale`` (at 1, B's entries are up to 1/sqrt(rank): each adapter changes the default
    model's weights by about as much as they are, and its greedy text is noise); adapter i's
    weights drawn from seed ``seed + i``."""
    import torch
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                        init_lora_weights=False)
    model = get_peft_model(load_base(model_path), config)
    lora = [(name.endswith("lora_B.default"), m) for name, m in model.named_modules()
            if name.endswith(("lora_A.default", "lora_B.default"))]
    paths = {}
    for i, name in enumerate(names):
        torch.manual_seed(seed + i)
        with torch.no_grad():
            for is_b, module in lora:
                module.reset_parameters()  # what init_lora_weights=False leaves
                if is_b:
                    module.weight.mul_(b_scale)
        paths[name] = out_dir / name
        model.save_pretrained(paths[name])
    return paths


def write_merged(model_path: str, adapter: Path, out: Path, dtype) -> Path:
    """The base model with ``adapter`` merged in, saved in ``dtype`` as a model directory
    with the base model's tokenizer and generation files."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_base(model_path), str(adapter))
    model.merge_and_unload().to(dtype).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "special_tokens_map.json", "vocab.json", "merges.txt"):
        if (Path(model_path) / name).exists() and not (out / name).exists():
            shutil.copy(Path(model_path) / name, out / name)
    return out
