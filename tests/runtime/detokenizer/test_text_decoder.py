"""The Detokenizer's Rust decoder decodes as transformers' tokenizer does, for every id list
(special tokens, split characters, ids out of order), on the tiny test tokenizer, the
default model's and a WordPiece one; it is refused where transformers would decode
otherwise; and an Engine's Detokenizer process then holds neither transformers nor torch."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tiny_models import tiny_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from radixlm.runtime.detokenizer.text_decoder import RustTextDecoder, backend_decoder_json


def decoder_for(tokenizer, tmp_path: Path) -> RustTextDecoder:
    serialized = backend_decoder_json(tokenizer)
    assert serialized is not None
    path = tmp_path / "decoder.json"
    path.write_text(serialized, encoding="utf-8")
    return RustTextDecoder(path)


def assert_decodes_alike(tokenizer, decoder: RustTextDecoder, seed: int = 0) -> None:
    rng = random.Random(seed)
    specials = list(tokenizer.all_special_ids)
    vocab = len(tokenizer)
    cases = [[], specials, list(range(min(vocab, 300)))]
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        ids[rng.randrange(len(ids)):rng.randrange(len(ids)) + 1] = rng.sample(
            specials, k=min(2, len(specials)))
        cases.append(ids)
    for ids in cases:
        for skip in (False, True):
            assert decoder.decode(ids, skip_special_tokens=skip) == tokenizer.decode(
                ids, skip_special_tokens=skip), (ids, skip)


def test_the_tiny_tokenizer_decodes_alike_without_its_merges(tmp_path):
    """The decoder drops a BPE model's merges (only encoding reads them) and still decodes
    every id list as the tokenizer with them does."""
    tokenizer = tiny_tokenizer()
    assert json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    decoder = decoder_for(tokenizer, tmp_path)
    assert json.loads(decoder._tokenizer.to_str())["model"]["merges"] == []
    assert_decodes_alike(tokenizer, decoder)


@pytest.mark.default_model
def test_the_default_models_tokenizer_decodes_alike(tmp_path):
    from radixlm.models.default_model import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path(progress=False))
    assert_decodes_alike(tokenizer, decoder_for(tokenizer, tmp_path))


def wordpiece_tokenizer(clean_up: bool) -> PreTrainedTokenizerFast:
    vocab = {"[UNK]": 0, "[CLS]": 1, "hello": 2, "world": 3, ",": 4, ".": 5, "##s": 6}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]",
                                   cls_token="[CLS]", clean_up_tokenization_spaces=clean_up)


def test_a_clean_up_of_spaces_is_left_to_transformers_where_it_would_run(tmp_path):
    cleaning = wordpiece_tokenizer(clean_up=True)
    assert cleaning.decode([2, 4, 3, 5]) == "hello, world."  # the clean-up ran
    assert backend_decoder_json(cleaning) is None
    plain = wordpiece_tokenizer(clean_up=False)
    assert_decodes_alike(plain, decoder_for(plain, tmp_path))


def test_a_tokenizer_class_that_decodes_its_own_way_is_left_to_transformers():
    class Shouting(PreTrainedTokenizerFast):
        def _decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return super()._decode(token_ids, skip_special_tokens, **kwargs).upper()

    tokenizer = tiny_tokenizer()
    shouting = Shouting(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|endoftext|>")
    assert backend_decoder_json(shouting) is None


def process_libraries(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/<pid>/maps")
def test_the_engines_detokenizer_process_loads_neither_transformers_nor_torch(engine_for):
    engine = engine_for()
    out = engine.generate("The quick brown fox", {"max_new_tokens": 8, "temperature": 0})
    assert out["text"] == engine.tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    processes = engine._runtime.processes
    assert "libtorch" not in process_libraries(processes["detokenizer"].pid)
    assert "libtorch" in process_libraries(processes["scheduler"].pid)  # the check can fail


@pytest.mark.slow  # the gemma-3 file's view (its 262,144-token tokenizer)
def test_gemma3s_tokenizer_from_its_gguf_decodes_alike(tmp_path):
    from gemma3_file import gemma3_gguf

    from radixlm.models.default_model import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(gemma3_gguf()))
    assert_decodes_alike(tokenizer, decoder_for(tokenizer, tmp_path))
