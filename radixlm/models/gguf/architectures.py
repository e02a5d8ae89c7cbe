"""How each GGUF architecture maps onto a Hugging Face model: its config and tensor names.

A GGUF names its architecture (``general.architecture``) and describes the model in keys
prefixed by it (``gemma3.block_count``); its tensors have llama.cpp's names (``blk.3.attn_q
.weight``). ``build_config`` writes the Hugging Face ``config.json`` the model class reads,
and ``hf_tensor_name`` / ``to_hf_layout`` give each tensor's Hugging Face name and undo what
llama.cpp's converter changed: q/k rows regrouped for its interleaved RoPE (``llama``), and
Gemma's norm weights stored as 1 + w. What llama.cpp hard-codes rather than stores (Gemma
3's pattern of local layers and their RoPE base, Gemma's query scaling) is set here the way
llama.cpp sets it.

Served: llama (Llama 1/2/3, SmolLM, Mistral), qwen2, qwen3, gemma2, gemma3 (text), phi3.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from radixlm.models.gguf.gguf_file import Metadata, clean_float


@dataclass(frozen=True, slots=True)
class GGUFArchitecture:
    """How one GGUF architecture maps onto a Hugging Face model class."""

    hf_architecture: str
    model_type: str
    permutes_qk: bool
    """llama.cpp regroups q/k rows of archs whose ggml RoPE is the interleaved kind."""
    block_tensors: dict[str, str]
    """GGUF per-layer tensor suffix -> Hugging Face name within ``model.layers.<i>.``; the
    ones marked optional in ``optional`` may be absent."""
    optional: frozenset[str] = frozenset()
    norm_shift: float = 0.0
    """What llama.cpp's converter added to every ``*norm.weight`` (Gemma: 1)."""


_LLAMA_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_QKV_BIAS = {f"attn_{x}.bias": f"self_attn.{x}_proj.bias" for x in "qkv"}
_QK_NORM = {"attn_q_norm.weight": "self_attn.q_norm.weight",
            "attn_k_norm.weight": "self_attn.k_norm.weight"}
_GEMMA_BLOCK = _LLAMA_BLOCK | {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_PHI3_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",  # gate rows, then up rows
    "ffn_down.weight": "mlp.down_proj.weight",
}

ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("LlamaForCausalLM", "llama", True, _LLAMA_BLOCK),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM", "qwen2", False, _LLAMA_BLOCK | _QKV_BIAS,
                              frozenset(_QKV_BIAS)),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", "qwen3", False, _LLAMA_BLOCK | _QK_NORM),
    "gemma2": GGUFArchitecture("Gemma2ForCausalLM", "gemma2", False, _GEMMA_BLOCK,
                               norm_shift=1.0),
    "gemma3": GGUFArchitecture("Gemma3ForCausalLM", "gemma3_text", False,
                               _GEMMA_BLOCK | _QK_NORM, norm_shift=1.0),
    "phi3": GGUFArchitecture("Phi3ForCausalLM", "phi3", False, _PHI3_BLOCK),
}
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
ROPE_FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
"""Phi-3's long-context RoPE factors: config values, not weights."""

GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_GLOBAL_EVERY = 6
"""llama.cpp's fixed Gemma 3 layout: every 6th layer global, local layers' RoPE base 10^4."""


def architecture(meta: Metadata) -> tuple[str, GGUFArchitecture]:
    """The file's architecture name and mapping; an unserved one is a ``ValueError``."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"GGUF file {str(meta.path)!r} has architecture {arch!r}; supported GGUF "
            f"architectures: {', '.join(ARCHITECTURES)}")
    return arch, ARCHITECTURES[arch]


def build_config(meta: Metadata, arch: str, tensors: dict[str, np.ndarray | tuple]) -> dict:
    """The Hugging Face ``config.json`` for this GGUF. ``tensors``: name -> shape in ggml
    order (fastest dim first), or for Phi-3's RoPE factors their values."""
    path = meta.path
    spec = ARCHITECTURES[arch]
    if "token_embd.weight" not in tensors:
        raise ValueError(f"GGUF file {str(path)!r} has no token_embd.weight tensor")
    hidden = int(meta.require(f"{arch}.embedding_length"))
    heads = int(meta.require(f"{arch}.attention.head_count"))
    layers = int(meta.require(f"{arch}.block_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    rotary_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rotary_dim != head_dim and arch != "phi3":
        raise ValueError(f"GGUF file {str(path)!r} rotates {rotary_dim} of {head_dim} head "
                         "dims; partial rotary embeddings are served for phi3 only")
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if arch not in ("phi3", "gemma3") and (
            scaling not in (None, "none") or "rope_freqs.weight" in tensors):
        raise ValueError(f"GGUF file {str(path)!r} uses RoPE scaling "
                         f"({scaling or 'rope_freqs.weight'}), which is not served for {arch}")
    vocab = meta.get(f"{arch}.vocab_size", tensors["token_embd.weight"][-1])
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    rope_theta = clean_float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    config = {
        "architectures": [spec.hf_architecture],
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "intermediate_size": int(meta.require(f"{arch}.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "num_hidden_layers": layers,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": clean_float(meta.require(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "max_position_embeddings": int(meta.require(f"{arch}.context_length")),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
        # Llama's switch biases every projection; Qwen2's q/k/v bias is its class's own.
        "attention_bias": arch == "llama" and "blk.0.attn_q.bias" in tensors,
        "torch_dtype": "float32",
    }
    if arch == "llama":
        config["mlp_bias"] = False
    if arch in ("gemma2", "gemma3"):
        config.update(_gemma_fields(meta, arch, config))
    if arch == "phi3":
        config.update(_phi3_fields(meta, config, rotary_dim, tensors))
    return config


def _gemma_fields(meta: Metadata, arch: str, config: dict) -> dict:
    """Gemma's GELU MLP, query scaling, windows, soft-caps and (Gemma 3) per-layer RoPE."""
    layers, hidden, heads = (config["num_hidden_layers"], config["hidden_size"],
                             config["num_attention_heads"])
    # llama.cpp scales queries by 1/sqrt(head_dim), except the 27B models (62 or 46 layers:
    # Gemma 3, Gemma 2), which use hidden / heads.
    big = layers == (62 if arch == "gemma3" else 46)
    window = int(meta.get(f"{arch}.attention.sliding_window", 4096))
    if arch == "gemma2":
        local = [i % 2 == 0 for i in range(layers)]
    else:
        local = [(i + 1) % GEMMA3_GLOBAL_EVERY != 0 for i in range(layers)]
    fields = {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": hidden // heads if big else config["head_dim"],
        "sliding_window": window,
        "layer_types": ["sliding_attention" if x else "full_attention" for x in local],
        "attn_logit_softcapping": _optional_float(
            meta.get(f"{arch}.attn_logit_softcapping")),
        "final_logit_softcapping": _optional_float(
            meta.get(f"{arch}.final_logit_softcapping")),
    }
    if arch == "gemma3":
        full = {"rope_type": "default", "rope_theta": config["rope_theta"]}
        if meta.get("gemma3.rope.scaling.type") == "linear":
            full = {**full, "rope_type": "linear",
                    "factor": clean_float(meta.require("gemma3.rope.scaling.factor"))}
        fields["rope_parameters"] = {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_BASE},
        }
        fields["rope_local_base_freq"] = GEMMA3_LOCAL_ROPE_BASE
    return fields


def _phi3_fields(meta: Metadata, config: dict, rotary_dim: int, tensors: dict) -> dict:
    """Phi-3's window, partial rotation and long-context RoPE factors (``longrope``)."""
    fields = {"partial_rotary_factor": rotary_dim / config["head_dim"],
              "sliding_window": meta.get("phi3.attention.sliding_window")}
    fields["rope_parameters"] = {**config["rope_parameters"],
                                 "partial_rotary_factor": fields["partial_rotary_factor"]}
    if "rope_factors_long.weight" in tensors:
        original = int(meta.require("phi3.rope.scaling.original_context_length"))
        fields["original_max_position_embeddings"] = original
        fields["rope_parameters"] = {
            "rope_type": "longrope", "rope_theta": config["rope_theta"],
            "long_factor": [float(x) for x in tensors["rope_factors_long.weight"]],
            "short_factor": [float(x) for x in tensors["rope_factors_short.weight"]],
            "original_max_position_embeddings": original,
            "partial_rotary_factor": fields["partial_rotary_factor"],
        }
        fields["rope_scaling"] = {k: v for k, v in fields["rope_parameters"].items()
                                  if k in ("long_factor", "short_factor")} | {"type": "longrope"}
    return fields


def _optional_float(value) -> float | None:
    return None if value is None else clean_float(value)


def hf_tensor_name(gguf_name: str, spec: GGUFArchitecture, num_layers: int,
                   path: Path) -> str | None:
    """The Hugging Face name of one GGUF tensor; None for tensors that are config values
    (``ROPE_FACTOR_TENSORS``); a tensor the mapping does not know is a ``ValueError``."""
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    if gguf_name in ROPE_FACTOR_TENSORS and spec.model_type == "phi3":
        return None
    prefix, _, rest = gguf_name.partition(".")
    layer, _, suffix = rest.partition(".")
    if prefix == "blk" and layer.isdigit() and int(layer) < num_layers \
            and suffix in spec.block_tensors:
        return f"model.layers.{layer}.{spec.block_tensors[suffix]}"
    raise ValueError(f"GGUF file {str(path)!r} holds tensor {gguf_name!r}, which is not "
                     f"mapped for architecture {spec.model_type!r}")


def expected_tensors(spec: GGUFArchitecture, config: dict) -> set[str]:
    """Every Hugging Face parameter name a complete file provides."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        names.add("lm_head.weight")
    for layer in range(config["num_hidden_layers"]):
        names.update(f"model.layers.{layer}.{hf}" for suffix, hf in spec.block_tensors.items()
                     if suffix not in spec.optional)
    return names


def expected_shape(hf_name: str, config: dict) -> tuple[int, ...] | None:
    """The shape (PyTorch order) the config implies for a Hugging Face tensor name, or None
    where the name has no fixed shape here."""
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    ffn, vocab = config["intermediate_size"], config["vocab_size"]
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "qkv_proj": q + 2 * kv,
            "gate_proj": ffn, "up_proj": ffn, "gate_up_proj": 2 * ffn}
    parts = hf_name.split(".")
    module, param = parts[-2], parts[-1]
    if module in ("embed_tokens", "lm_head"):
        return (vocab, hidden)
    if module in ("q_norm", "k_norm"):
        return (head_dim,)
    if module.endswith("norm"):
        return (hidden,)
    if module == "o_proj":
        return (hidden, q) if param == "weight" else (hidden,)
    if module == "down_proj":
        return (hidden, ffn) if param == "weight" else (hidden,)
    if module in rows:
        return (rows[module], hidden) if param == "weight" else (rows[module],)
    return None


def unpermute_rotary_rows(weight, num_heads: int):
    """q/k projection rows (numpy or torch, rows first) in Hugging Face order, undoing
    llama.cpp's permutation: Hugging Face Llama rotates the two halves of each head
    (``rotate_half``), ggml's llama RoPE adjacent pairs, so llama.cpp's converter stored each
    head's rows ``[h0 .. h(d/2-1) | h(d/2) .. h(d-1)]`` as pairs ``(h0, h(d/2)), ...``. This
    is the exact inverse, a reordering of whole rows: it applies as well to a 1-D bias and to
    the byte rows of a block-quantized matrix."""
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"cannot un-permute {rows} rows into {num_heads} heads of even size")
    head_dim = rows // num_heads
    # (heads, 2, head_dim/2, ...) in HF order was stored as (heads, head_dim/2, 2, ...).
    stored = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return stored.swapaxes(1, 2).reshape(weight.shape)


def to_hf_layout(gguf_name: str, weight, spec: GGUFArchitecture, config: dict, path: Path):
    """A tensor (float values, or a block-quantized matrix's byte rows) as the Hugging Face
    checkpoint holds it: q/k rows un-permuted where the architecture needs it (their count
    checked against the heads), Gemma's norm shift taken off (float norms only)."""
    heads_of = {".attn_q.": config["num_attention_heads"],
                ".attn_k.": config["num_key_value_heads"]}
    for marker, heads in heads_of.items():
        if marker not in gguf_name:
            continue
        if weight.shape[0] != heads * config["head_dim"]:
            raise ValueError(
                f"GGUF file {str(path)!r}: {gguf_name} has {weight.shape[0]} rows, expected "
                f"{heads} heads x head_dim {config['head_dim']}")
        if spec.permutes_qk:
            weight = unpermute_rotary_rows(weight, heads)
    if spec.norm_shift and gguf_name.endswith("norm.weight"):
        weight = weight - spec.norm_shift
    return weight
