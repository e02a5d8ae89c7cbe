"""The tokenizer a GGUF file carries, rebuilt as a Hugging Face tokenizer directory.

transformers' GGUF tokenizer converter builds the tokenizer from the metadata; this module
writes it as ``tokenizer.json`` and ``tokenizer_config.json``, with the BOS/EOS the file asks
for baked into the post-processor and, for the pre-tokenizers that split digits, the split
the original tokenizer does. A file without a chat template gets its family's (Gemma's
turns), as llama.cpp gives one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")

GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') "
    "+ message['content'] | trim + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
"""Gemma's turn format (``<start_of_turn>role ... <end_of_turn>``, the system message
folded into the first user turn), for Gemma GGUFs that carry no template."""
DEFAULT_CHAT_TEMPLATES = {"gemma2": GEMMA_CHAT_TEMPLATE, "gemma3": GEMMA_CHAT_TEMPLATE}
END_OF_TURN_TOKENS = {"gemma2": "<end_of_turn>", "gemma3": "<end_of_turn>"}
"""The token that ends a chat turn where it is not the file's EOS: generation stops at it
too (as llama.cpp and the models' own generation configs do)."""


def end_of_turn_ids(directory: Path, arch: str) -> list[int]:
    """The ids of ``arch``'s end-of-turn token in the tokenizer written to ``directory``."""
    from tokenizers import Tokenizer

    token = END_OF_TURN_TOKENS.get(arch)
    if token is None:
        return []
    found = Tokenizer.from_file(str(directory / "tokenizer.json")).token_to_id(token)
    return [] if found is None else [found]


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


def write_tokenizer(
    gguf_path: Path, directory: Path, model_max_length: int, pre_tokenizer_type: str | None,
    arch: str,
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
    template = tok.chat_template or DEFAULT_CHAT_TEMPLATES.get(arch)
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
