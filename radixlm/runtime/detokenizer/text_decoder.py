"""Token ids to text in the Detokenizer's process without transformers, and so without
torch: the process then holds only the Rust tokenizer.

transformers' fast tokenizers decode with their Rust ``tokenizers.Tokenizer``
(``TokenizersBackend._decode``: the backend's ``decode``, then a clean-up of spaces that
transformers skips for BPE models). The Engine's process, which loads transformers'
tokenizer anyway, hands the Detokenizer that backend as JSON (``backend_decoder_json``)
where decoding is exactly the backend's: the class decodes as ``TokenizersBackend`` does
and no clean-up applies. Anything else (a slow tokenizer, a class of its own decoding, a
clean-up that would run) gets ``None``, and the Detokenizer loads transformers' tokenizer as
before.

The Detokenizer's copy drops a BPE model's merges (``without_merges``): only encoding reads
them.

Invariant: ``RustTextDecoder(json).decode(ids, skip)`` equals the tokenizer's
``decode(ids, skip_special_tokens=skip)`` for every id list, where ``json`` came from
``backend_decoder_json`` (``tests/runtime/detokenizer/test_text_decoder.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class TextDecoder(Protocol):
    """What detokenization needs of a tokenizer: transformers' or ``RustTextDecoder``."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False,
               spaces_between_special_tokens: bool = True) -> str: ...


def backend_decoder_json(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The Rust tokenizer ``tokenizer.decode`` runs, serialized, where its decoding is that
    tokenizer's alone; else None."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    kind = type(tokenizer)
    if (not isinstance(tokenizer, TokenizersBackend)
            or kind._decode is not TokenizersBackend._decode
            or kind.decode is not PreTrainedTokenizerBase.decode):
        return None
    backend = tokenizer.backend_tokenizer
    if tokenizer.clean_up_tokenization_spaces:  # skipped by transformers for BPE, unless told
        forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_"
                                    "corrupt_output", True)
        if type(backend.model).__name__ != "BPE" or forced:
            return None
    return backend.to_str()


class RustTextDecoder:
    """``decode`` as the Engine's tokenizer decodes, from ``backend_decoder_json``'s JSON
    (a file the Engine wrote into its private runtime directory)."""

    def __init__(self, path: str | Path):
        import tokenizers

        self._tokenizer = tokenizers.Tokenizer.from_str(
            without_merges(Path(path).read_text(encoding="utf-8")))

    def decode(self, ids: list[int], skip_special_tokens: bool = False,
               spaces_between_special_tokens: bool = True) -> str:
        """The text of ``ids``; ``spaces_between_special_tokens`` is accepted and, as by
        transformers' fast tokenizers, not used."""
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def without_merges(tokenizer_json: str) -> str:
    """A serialized tokenizer with its BPE merges dropped: they only say how text is split
    into tokens, and decoding (each id's token, then the decoders) never reads them; a large
    vocabulary's merges are a good part of the Rust tokenizer's memory
    (benchmarks/RESULTS.md)."""
    import json

    tokenizer = json.loads(tokenizer_json)
    model = tokenizer.get("model") or {}
    if model.get("type") != "BPE" or not model.get("merges"):
        return tokenizer_json
    model["merges"] = []
    return json.dumps(tokenizer)
