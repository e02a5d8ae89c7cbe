"""Convert a GGUF checkpoint (llama.cpp's file format) into a Hugging Face model directory.

The runtime loads Hugging Face directories (`config.json`, `model.safetensors`, `tokenizer.json`),
so a GGUF file is converted once: every tensor is dequantized to float32 with the `gguf` package,
renamed to the Hugging Face name, and the query/key rows that llama.cpp stores in its rotary
order are put back in Hugging Face's order. The tokenizer is rebuilt from the GGUF metadata with
transformers' own GGUF tokenizer converter.

Supported GGUF architectures: llama (Llama 1/2-style, SmolLM), qwen2 and qwen3.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GGUFArchitecture:
    """How one GGUF architecture maps onto a Hugging Face model class."""

    hf_architecture: str
    model_type: str
    # llama.cpp reorders q/k rows for archs whose ggml RoPE is the interleaved (GPT-J) kind.
    permutes_qk: bool
    # Per-layer GGUF tensor suffixes this architecture may carry beyond the llama set.
    extra_block_tensors: tuple[str, ...] = ()


SUPPORTED_GGUF_ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("LlamaForCausalLM", "llama", permutes_qk=True),
    "qwen2": GGUFArchitecture(
        "Qwen2ForCausalLM",
        "qwen2",
        permutes_qk=False,
        extra_block_tensors=("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    ),
    "qwen3": GGUFArchitecture(
        "Qwen3ForCausalLM",
        "qwen3",
        permutes_qk=False,
        extra_block_tensors=("attn_q_norm.weight", "attn_k_norm.weight"),
    ),
}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_LLAMA_BLOCK_TENSORS = {
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
_BLOCK_TENSORS = _LLAMA_BLOCK_TENSORS | {
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Return q/k projection rows in Hugging Face order, undoing llama.cpp's permutation.

    Hugging Face Llama rotates the two halves of each head (`rotate_half`); ggml's llama RoPE
    rotates adjacent pairs, so llama.cpp's converter regroups each head's rows from
    `[h0 .. h(d/2-1) | h(d/2) .. h(d-1)]` into pairs `(h0, h(d/2)), (h1, h(d/2+1)), ...`.
    This is the exact inverse; it is a row reordering, so it also applies to a 1-D bias.
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"cannot un-permute {rows} rows into {num_heads} heads of even size")
    head_dim = rows // num_heads
    # (heads, 2, head_dim/2, ...) in HF order was stored as (heads, head_dim/2, 2, ...).
    stored = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return stored.swapaxes(1, 2).reshape(weight.shape)


GGUF_WEIGHT_FORMATS = {"F16": "fp16wo", "Q8_0": "int8wo"}
"""The weight-only format (``layers/weight_formats.py``) that keeps what a GGUF stores of
its layers' matrices: F16 exactly; Q8_0 (a scale per 32 weights) re-scaled per row."""


def gguf_weight_format(path: str | os.PathLike) -> str | None:
    """The format for the GGUF at ``path``, by the type most of its layers' matrices have;
    None for other types (float32, 4-bit, ...: served in the serving dtype)."""
    reader = _open_reader(Path(path))
    types = Counter(t.tensor_type.name for t in reader.tensors
                    if t.name.startswith("blk.") and len(t.shape) == 2)
    return GGUF_WEIGHT_FORMATS.get(types.most_common(1)[0][0]) if types else None


def _open_reader(path: Path):
    """Open `path` with gguf.GGUFReader; anything unreadable becomes a ValueError naming it."""
    import gguf

    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    try:
        return gguf.GGUFReader(path)
    except Exception as err:  # the reader raises ValueError, IndexError, struct/OS errors
        raise ValueError(f"{str(path)!r} is not a readable GGUF file: {err}") from err


class _Metadata:
    """Typed access to the scalar GGUF metadata keys, with errors that name the file and key."""

    def __init__(self, reader, path: Path) -> None:
        self._reader = reader
        self._path = path

    def get(self, key: str, default=None):
        field = self._reader.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise ValueError(f"GGUF file {str(self._path)!r} lacks the metadata key {key!r}")
        return value


def _clean_float(value: float) -> float:
    """A float32 metadata value as its shortest decimal (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _build_config(
    meta: _Metadata, arch: str, tensor_shapes: dict[str, list[int]], path: Path
) -> dict:
    """The Hugging Face `config.json` contents for this GGUF; rejects features we cannot map."""
    spec = SUPPORTED_GGUF_ARCHITECTURES[arch]
    tensor_names = set(tensor_shapes)
    if "token_embd.weight" not in tensor_names:
        raise ValueError(f"GGUF file {str(path)!r} has no token_embd.weight tensor")
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if (scaling not in (None, "none")) or "rope_freqs.weight" in tensor_names:
        raise ValueError(
            f"GGUF file {str(path)!r} uses RoPE scaling ({scaling or 'rope_freqs.weight'}), "
            "which the GGUF converter does not support; convert the original checkpoint instead"
        )
    hidden = int(meta.require(f"{arch}.embedding_length"))
    heads = int(meta.require(f"{arch}.attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    rotary_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise ValueError(
            f"GGUF file {str(path)!r} rotates {rotary_dim} of {head_dim} head dims; "
            "partial rotary embeddings are not supported"
        )
    # ggml lists dims fastest-first, so token_embd is (hidden, vocab) there.
    vocab = meta.get(f"{arch}.vocab_size", tensor_shapes["token_embd.weight"][-1])
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    rope_theta = _clean_float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    config = {
        "architectures": [spec.hf_architecture],
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "intermediate_size": int(meta.require(f"{arch}.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "num_hidden_layers": int(meta.require(f"{arch}.block_count")),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _clean_float(meta.require(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "max_position_embeddings": int(meta.require(f"{arch}.context_length")),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "torch_dtype": "float32",
    }
    if arch == "llama":
        config["mlp_bias"] = False
    return config


def _hf_tensor_name(gguf_name: str, arch: str, num_layers: int, path: Path) -> str:
    """The Hugging Face parameter name of one GGUF tensor; unknown tensors raise ValueError."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, suffix = rest.partition(".")
    allowed = tuple(_LLAMA_BLOCK_TENSORS) + SUPPORTED_GGUF_ARCHITECTURES[arch].extra_block_tensors
    if prefix == "blk" and layer.isdigit() and int(layer) < num_layers and suffix in allowed:
        return f"model.layers.{layer}.{_BLOCK_TENSORS[suffix]}"
    raise ValueError(
        f"GGUF file {str(path)!r} holds tensor {gguf_name!r}, which the converter cannot map "
        f"for architecture {arch!r}"
    )


def _expected_tensors(arch: str, config: dict) -> set[str]:
    """Every Hugging Face parameter the converted checkpoint must contain."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        names.add("lm_head.weight")
    suffixes = tuple(_LLAMA_BLOCK_TENSORS) + SUPPORTED_GGUF_ARCHITECTURES[arch].extra_block_tensors
    for layer in range(config["num_hidden_layers"]):
        names.update(f"model.layers.{layer}.{_BLOCK_TENSORS[s]}" for s in suffixes)
    return names


def _convert_tensors(reader, arch: str, config: dict, path: Path, progress: bool):
    """Dequantize, rename and un-permute every tensor: {hf_name: float32 C-contiguous array}."""
    from gguf.quants import dequantize

    spec = SUPPORTED_GGUF_ARCHITECTURES[arch]
    heads_of = {
        ".attn_q.": config["num_attention_heads"],
        ".attn_k.": config["num_key_value_heads"],
    }
    tensors: dict[str, np.ndarray] = {}
    for tensor in tqdm(reader.tensors, desc="radixlm: dequantizing GGUF", disable=not progress):
        hf_name = _hf_tensor_name(tensor.name, arch, config["num_hidden_layers"], path)
        weight = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        for marker, heads in heads_of.items():
            if marker not in tensor.name:
                continue
            if weight.shape[0] != heads * config["head_dim"]:
                raise ValueError(
                    f"GGUF file {str(path)!r}: {tensor.name} has {weight.shape[0]} rows, "
                    f"expected {heads} heads x head_dim {config['head_dim']}"
                )
            if spec.permutes_qk:
                weight = unpermute_rotary_rows(weight, heads)
        tensors[hf_name] = np.ascontiguousarray(weight)
    missing = sorted(_expected_tensors(arch, config) - tensors.keys())
    if missing:
        raise ValueError(
            f"GGUF file {str(path)!r} lacks {len(missing)} tensors, e.g. {missing[:3]}"
        )
    return tensors


def convert_gguf_to_hf(
    gguf_path: str | os.PathLike, out_dir: str | os.PathLike, progress: bool = True
) -> Path:
    """Convert `gguf_path` into a Hugging Face model directory at `out_dir` and return it.

    Guarantees: `out_dir` appears complete or not at all (everything is written into a temporary
    sibling directory that is renamed at the end); it holds `config.json`, a float32
    `model.safetensors` with every parameter the config implies (`lm_head.weight` only when the
    GGUF has `output.weight`), `tokenizer.json`, `tokenizer_config.json` (chat template, special
    tokens, `add_bos_token` as the GGUF states) and `generation_config.json`.

    Raises FileNotFoundError if `gguf_path` is missing, FileExistsError if `out_dir` exists and
    is not empty, and ValueError (naming the path) for a corrupt or non-GGUF file, an unsupported
    architecture, or a tensor or feature the converter cannot map.
    """
    path, out = Path(gguf_path), Path(out_dir)
    reader = _open_reader(path)
    meta = _Metadata(reader, path)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF file {str(path)!r} has architecture {arch!r}; supported GGUF architectures: "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    if "tokenizer.ggml.model" not in reader.fields:
        raise ValueError(f"GGUF file {str(path)!r} carries no tokenizer (tokenizer.ggml.model)")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"output directory {str(out)!r} exists and is not empty")
    shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    config = _build_config(meta, arch, shapes, path)
    tensors = _convert_tensors(reader, arch, config, path, progress)

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        _write_model_files(staging, config, tensors, path, meta.get("tokenizer.ggml.pre"))
        _apply_umask_permissions(staging)
        if out.exists():
            out.rmdir()  # empty (checked above); os.replace cannot replace a directory portably
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("converted %s into %s", path, out)
    return out


def _write_model_files(
    directory: Path, config: dict, tensors: dict, gguf_path: Path, tokenizer_pre_type: str | None
) -> None:
    """Write config, weights, tokenizer and generation config into `directory`."""
    from safetensors.numpy import save_file

    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    _write_json(directory / "config.json", config)
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    _write_json(directory / "generation_config.json", generation)
    _write_tokenizer(gguf_path, directory, config["max_position_embeddings"], tokenizer_pre_type)


def _apply_umask_permissions(directory: Path) -> None:
    """Give the staged directory the modes a plain mkdir/open would (mkdtemp makes it 0700)."""
    # A fresh file's mode reveals the umask without os.umask's process-wide set-and-restore.
    probe = directory / ".umask-probe"
    probe.touch(mode=0o666)
    file_mode = probe.stat().st_mode & 0o777
    probe.unlink()
    for child in directory.iterdir():
        child.chmod(file_mode)
    directory.chmod(file_mode | ((file_mode & 0o444) >> 2))  # read bit implies search bit


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


@dataclass(frozen=True, slots=True)
class _GGUFTokenizer:
    """A tokenizer rebuilt from GGUF metadata, before it is written to disk."""

    backend: object  # tokenizers.Tokenizer
    special_tokens: dict[str, str | None]  # bos_token, eos_token, unk_token, pad_token
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None


# llama.cpp pre-tokenizers that isolate every digit before the GPT-2 split, as the original
# Hugging Face tokenizers do with `Digits(individual_digits=True)`. transformers' GGUF converter
# falls back to the plain GPT-2 split for these, which tokenizes "x  1" as x,Ġ,Ġ,1 instead of
# SmolLM2's x,ĠĠ,1.
_DIGIT_SPLIT_PRE_TOKENIZERS = frozenset({"smollm", "starcoder", "refact", "codeshell"})


def _read_gguf_tokenizer(path: Path) -> _GGUFTokenizer:
    """Build the tokenizer the GGUF describes with transformers' GGUF tokenizer converter.

    `add_bos_token` follows the GGUF's `tokenizer.ggml.add_bos_token`; transformers defaults a
    missing flag to True for sentencepiece ("llama") vocabularies and to False for byte-level BPE
    ("gpt2"), as llama.cpp and the original Hugging Face tokenizers do.
    """
    try:  # transformers >= 5: reads only the metadata, then builds the backend (the fast route)
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    except ImportError:  # older transformers: the public (slower) AutoTokenizer route
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        return _GGUFTokenizer(
            backend=tok.backend_tokenizer,
            special_tokens={name: getattr(tok, name) for name in _SPECIAL_TOKEN_NAMES},
            add_bos_token=bool(getattr(tok, "add_bos_token", False)),
            add_eos_token=bool(getattr(tok, "add_eos_token", False)),
            chat_template=tok.chat_template,
        )
    architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(path))
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return _GGUFTokenizer(
        backend=backend,
        special_tokens={name: tokenizer_config.get(name) for name in _SPECIAL_TOKEN_NAMES},
        add_bos_token=bool(tokenizer_config.get("add_bos_token", False)),
        add_eos_token=bool(tokenizer_config.get("add_eos_token", False)),
        chat_template=tokenizer_config.get("chat_template"),
    )


def _write_tokenizer(
    gguf_path: Path, directory: Path, model_max_length: int, pre_tokenizer_type: str | None
) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` for the GGUF's tokenizer.

    The BOS/EOS that `add_bos_token`/`add_eos_token` ask for is also baked into tokenizer.json's
    post-processor, so a bare `tokenizers.Tokenizer.from_file` encodes like AutoTokenizer does.
    For the digit-splitting pre-tokenizers (SmolLM2's "smollm") the pre-tokenizer is rebuilt as
    the original Hugging Face tokenizer (and llama.cpp) splits text.
    """
    from tokenizers import pre_tokenizers, processors

    tok = _read_gguf_tokenizer(gguf_path)
    if pre_tokenizer_type in _DIGIT_SPLIT_PRE_TOKENIZERS:
        tok.backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    bos, eos = tok.special_tokens["bos_token"], tok.special_tokens["eos_token"]
    prefix = [bos] if tok.add_bos_token and bos else []
    suffix = [eos] if tok.add_eos_token and eos else []
    if prefix or suffix:
        single = " ".join([*prefix, "$A", *suffix])
        second = " ".join(f"{piece}:1" for piece in [*prefix, "$B", *suffix])
        pair = f"{single} {second}"
        specials = [(t, tok.backend.token_to_id(t)) for t in dict.fromkeys(prefix + suffix)]
        tok.backend.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=specials
        )
    tok.backend.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **tok.special_tokens,
        "add_bos_token": tok.add_bos_token,
        "add_eos_token": tok.add_eos_token,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    if tok.chat_template is not None:
        config["chat_template"] = tok.chat_template
    _write_json(directory / "tokenizer_config.json", config)
