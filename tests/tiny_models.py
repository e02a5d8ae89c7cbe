"""Tiny randomly initialised ``transformers`` models, written to disk, and their references.

Each model directory holds a config, float32 safetensors, and a small byte-level BPE
tokenizer trained here, so the Engine loads it exactly like a real checkpoint.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

VOCAB_SIZE = 384
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "def add(a, b):\n    return a + b\n",
    "In 1492, Columbus sailed the ocean blue. Numbers: 0 1 2 3 4 5 6 7 8 9.",
    "Héllo wörld, ünïcödé and emoji \U0001f600 are bytes too.",
] * 20

# (architecture, config class, extra config fields)
ARCHITECTURES = {
    "LlamaForCausalLM": (transformers.LlamaConfig, {}),
    "MistralForCausalLM": (transformers.MistralConfig, {"sliding_window": None}),
    "Qwen2ForCausalLM": (transformers.Qwen2Config, {}),
    "Qwen3ForCausalLM": (transformers.Qwen3Config, {"head_dim": 16}),
}
# Mixture-of-experts models (tests/models/test_moe_models.py): 8 experts, top-2.
MOE_ARCHITECTURES = {
    "MixtralForCausalLM": (
        transformers.MixtralConfig,
        {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None},
    ),
    "Qwen2MoeForCausalLM": (
        transformers.Qwen2MoeConfig,
        # Layer 0 dense (mlp_only_layers), layer 1 routed + gated shared expert.
        {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "shared_expert_intermediate_size": 48, "mlp_only_layers": [0]},
    ),
    "Qwen3MoeForCausalLM": (
        transformers.Qwen3MoeConfig,
        {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "norm_topk_prob": True, "head_dim": 16},
    ),
}
# Multi-head latent attention models (tests/models/test_deepseek_models.py).
MLA_ARCHITECTURES = {
    # MLA: a 32-dim latent + 8 RoPE dims cached per token; 16 + 8 qk and 16 v dims per head.
    # V2 as V2-Lite (no q-LoRA, greedy softmax router), V3 with q-LoRA and its sigmoid router;
    # layer 0 dense, layer 1 MoE. ``first_k_dense_replace=2`` makes every layer dense.
    "DeepseekV2ForCausalLM": (transformers.DeepseekV2Config, dict(
        kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, moe_intermediate_size=32, topk_method="greedy",
    )),
    "DeepseekV3ForCausalLM": (transformers.DeepseekV3Config, dict(
        kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, moe_intermediate_size=32, n_group=4, topk_group=2,
    )),
}
# Models with sliding-window layers (tests/models/test_gemma_models.py, test_phi3_models.py):
# a window of 12 tokens, so the tests' prompts and outputs cross it; head_dim 16.
WINDOW = 12
WINDOWED_ARCHITECTURES = {
    # Layer 0 local, layer 1 global; softcaps small enough to bite on these weights.
    "Gemma2ForCausalLM": (transformers.Gemma2Config, dict(
        head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
    )),
    # Local layers on their own (unscaled, short-base) RoPE; the global one linearly scaled.
    "Gemma3ForCausalLM": (transformers.Gemma3TextConfig, dict(
        head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        },
    )),
    # Half of each head rotated, by LongRoPE (short factors below 64 positions, long beyond).
    "Phi3ForCausalLM": (transformers.Phi3Config, dict(
        sliding_window=WINDOW, original_max_position_embeddings=64, pad_token_id=None,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "factor": 8.0,
            "short_factor": [1.0, 1.3, 2.1, 3.7], "long_factor": [1.5, 2.5, 4.0, 8.0],
        },
    )),
}
KV_HEADS = {"mha": 4, "gqa": 2, "mqa": 1}


@functools.lru_cache(maxsize=1)
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    )


def write_tiny_model(
    directory: Path, architecture: str = "LlamaForCausalLM", kv: str = "gqa",
    tied: bool = False, seed: int = 0, **overrides,
) -> Path:
    """Writes a 2-layer model of ``architecture`` into ``directory`` and returns it."""
    config_class, extra = {**ARCHITECTURES, **MOE_ARCHITECTURES, **MLA_ARCHITECTURES,
                           **WINDOWED_ARCHITECTURES}[architecture]
    tokenizer = tiny_tokenizer()
    fields = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS[kv],
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        initializer_range=0.1,  # peaky logits: greedy ties between implementations are unlikely
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        architectures=[architecture],
        **extra,
    )
    fields.update(overrides)
    config = config_class(**fields)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).float().eval()
    if architecture in WINDOWED_ARCHITECTURES:
        # Norm weights start at the identity (Gemma's zeros): perturbed, a wrong convention shows.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.add_(0.2 * torch.randn_like(param))
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


def write_tiny_gemma3_multimodal(directory: Path, seed: int = 0) -> Path:
    """Writes a ``Gemma3ForConditionalGeneration`` (the tiny Gemma 3 text decoder of
    ``write_tiny_model`` beside a one-layer SigLIP vision tower and its projector), as
    transformers saves it: the hub's ``language_model.model.*`` names."""
    tokenizer = tiny_tokenizer()
    _, extra = WINDOWED_ARCHITECTURES["Gemma3ForCausalLM"]
    text = transformers.Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.1, **extra)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14)
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4,
        image_token_index=len(tokenizer) - 1, boi_token_index=len(tokenizer) - 2,
        eoi_token_index=len(tokenizer) - 3, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id, architectures=["Gemma3ForConditionalGeneration"])
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():  # norms off Gemma's identity start, as write_tiny_model does
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


@functools.lru_cache(maxsize=8)
def reference_model(directory: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32
    ).eval()


@torch.inference_mode()
def reference_prompt_logprobs(directory: Path, input_ids: list[int]) -> torch.Tensor:
    """log p(token_i | tokens_<i) for i >= 1, from transformers: (len - 1,)."""
    logits = reference_model(directory)(torch.tensor([input_ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs[:-1].gather(1, torch.tensor(input_ids[1:])[:, None])[:, 0]


@torch.inference_mode()
def reference_greedy(directory: Path, input_ids: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy continuation, EOS included like any other token."""
    model = reference_model(directory)
    out = model(torch.tensor([input_ids]), use_cache=True)
    tokens = []
    for _ in range(num_tokens):
        tokens.append(int(out.logits[0, -1].argmax()))
        # transformers 5 calls the KV cache ``cache``; 4.x called it ``past_key_values``.
        name = "cache" if "cache" in out else "past_key_values"
        out = model(torch.tensor([[tokens[-1]]]), use_cache=True, **{name: out[name]})
    return tokens


def assert_prompt_logprobs_match(path, prompt_ids: list[int], out: dict, start: int) -> None:
    """Our logprobs of prompt tokens start+1 .. L-1 equal transformers' within 1e-4."""
    entries = out["meta_info"]["input_token_logprobs"]
    if start == 0:
        assert entries[0] == [None, prompt_ids[0], None]
        entries = entries[1:]
    assert [entry[1] for entry in entries] == prompt_ids[start + 1 :]
    theirs = reference_prompt_logprobs(path, prompt_ids)[start:]
    got = torch.tensor([entry[0] for entry in entries])
    torch.testing.assert_close(got, theirs, atol=1e-4, rtol=0)
