"""What the runtime needs to know of a model, read once from its Hugging Face config."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoConfig, PretrainedConfig


@dataclass
class ModelConfig:
    """The architecture facts the runtime sizes pools and picks kernels by.

    ``hf_config`` keeps the full Hugging Face config for the model files, ``text_config``
    the part the served decoder is built from (the same config but for a multimodal
    checkpoint, e.g. Gemma 3's ``Gemma3ForConditionalGeneration``, whose text decoder is
    served alone); the fields here are the ones the runtime itself reads (KV layout,
    vocabulary, context, stop tokens), all of them the text decoder's.
    """

    path: Path
    hf_config: PretrainedConfig
    text_config: PretrainedConfig
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    kv_lora_rank: int | None = None
    """Multi-head latent attention (DeepSeek-V2/V3): the size of the compressed KV latent
    each token caches instead of per-head K and V; None: the MHA (K and V) layout."""
    qk_rope_head_dim: int = 0
    """MLA: the dims of the decoupled RoPE key cached next to the latent."""
    sliding_window: int | None = None
    """W of the layers that attend to a sliding window of their W most recent keys
    (``AttentionLayer.sliding_window``); None: every layer attends to all keys."""
    sliding_layers: frozenset[int] = frozenset()
    """The ids of those layers (all of them for Mistral and Phi-3; Gemma 2/3's local ones)."""
    eos_token_ids: set[int] = field(default_factory=set)
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    """Sampling defaults from generation_config.json (temperature, top_p, top_k)."""

    @classmethod
    def from_path(cls, path: str | Path, trust_remote_code: bool = False) -> ModelConfig:
        path = Path(path)
        try:
            hf = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (ValueError, OSError, KeyError) as err:
            raise ValueError(f"cannot read the model config in {path}: {err}") from err
        architectures = getattr(hf, "architectures", None) or []
        if not architectures:
            raise ValueError(f"{path}/config.json names no 'architectures'")
        full, hf = hf, hf.get_text_config()  # a multimodal checkpoint's text decoder
        num_heads = hf.num_attention_heads
        num_kv_heads = getattr(hf, "num_key_value_heads", None) or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        kv_lora_rank = getattr(hf, "kv_lora_rank", None)
        generation = _read_generation_config(path)
        window, sliding = attention_windows(hf)
        eos = (_as_id_set(generation.get("eos_token_id")) | _as_id_set(full.eos_token_id)
               | _as_id_set(getattr(hf, "eos_token_id", None)))
        return cls(
            path=path,
            hf_config=full,
            text_config=hf,
            architecture=architectures[0],
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            hidden_size=hf.hidden_size,
            vocab_size=hf.vocab_size,
            max_position_embeddings=getattr(hf, "max_position_embeddings", 4096),
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=hf.qk_rope_head_dim if kv_lora_rank is not None else 0,
            sliding_window=window,
            sliding_layers=sliding,
            eos_token_ids=eos,
            generation_defaults=_sampling_defaults(generation),
        )

    @property
    def uses_mla(self) -> bool:
        """Whether the KV pool holds MLA latents (``MLATokenToKVPool``) rather than K and V."""
        return self.kv_lora_rank is not None

    def kv_bytes_per_token(self, dtype_size: int) -> int:
        """Bytes of KV one token occupies across all layers, in the pool layout the model uses:
        K and V per KV head (MHA), or one latent + RoPE key row (MLA)."""
        if self.kv_lora_rank is not None:
            return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * dtype_size
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_size


def attention_windows(hf_config: PretrainedConfig) -> tuple[int | None, frozenset[int]]:
    """(W, the layers that attend to their W most recent keys) of a Hugging Face config, or
    (None, empty) where every layer sees all keys. Read as transformers does: ``layer_types``
    ("sliding_attention" / "full_attention") where the config has it; else Gemma 2's
    alternation (even layers local), Gemma 3's ``sliding_window_pattern`` (every n-th layer
    global), and ``sliding_window`` on every layer (Mistral, Phi-3) unless
    ``use_sliding_window`` is false (Qwen2)."""
    window = getattr(hf_config, "sliding_window", None)
    layers = hf_config.num_hidden_layers
    if not window or getattr(hf_config, "use_sliding_window", True) is False:
        return None, frozenset()
    types = getattr(hf_config, "layer_types", None)
    model_type = getattr(hf_config, "model_type", "")
    if types:
        sliding = {i for i, kind in enumerate(types) if kind == "sliding_attention"}
    elif model_type == "gemma2":
        sliding = set(range(0, layers, 2))
    elif model_type in ("gemma3", "gemma3_text"):
        pattern = getattr(hf_config, "sliding_window_pattern", 6)
        sliding = {i for i in range(layers) if (i + 1) % pattern}
    else:
        sliding = set(range(layers))
    return (int(window), frozenset(sliding)) if sliding else (None, frozenset())


def rope_parameters(hf_config: PretrainedConfig) -> dict[str, Any]:
    """The RoPE settings as one dict with ``rope_type`` and ``rope_theta``.

    transformers 5 keeps them in ``config.rope_parameters``; 4.x in ``rope_theta`` and
    ``rope_scaling``. Both are read so either version's configs load.
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None)
    if isinstance(scaling, dict):
        params = {**scaling, **params}
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def _read_generation_config(path: Path) -> dict[str, Any]:
    file = path / "generation_config.json"
    if not file.exists():
        return {}
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{file} is not valid JSON: {err}") from err


def _sampling_defaults(generation: dict[str, Any]) -> dict[str, Any]:
    """The sampling settings of a generation config, in radixlm's terms (top_k 0 is "off")."""
    defaults = {k: generation[k] for k in ("temperature", "top_p", "top_k") if k in generation}
    if defaults.get("top_k") in (0, None):
        defaults.pop("top_k", None)
    return defaults


def _as_id_set(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}
