"""The public gemma-3-270m Q4_K_M GGUF served as stored, against transformers' Gemma 3 on
the same weights dequantized by the ``gguf`` package (float32 both)."""

from __future__ import annotations

import pytest
import torch
from gemma3_file import gemma3_gguf
from transformers import AutoModelForCausalLM, AutoTokenizer

import radixlm
from radixlm.models.gguf.conversion import convert_gguf_to_hf

pytestmark = pytest.mark.slow  # a 270M model twice, float32: CI's last stage

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined a screw press with movable metal type, an oil-based ink and a mould "
    "for casting letters quickly. Books had been copied by hand for centuries before that, "
    "slowly and at great cost, so that a single volume could be worth as much as a house. "
    "Within fifty years presses were at work in more than two hundred cities across Europe, "
    "and millions of copies had been printed: bibles, grammars, almanacs, pamphlets and "
    "broadsheets. Scholars could now compare identical copies of a text, errors could be "
    "corrected in a new edition instead of multiplying with every scribe, and ideas travelled "
    "faster than any authority could follow them. The Reformation, the scientific revolution "
    "and the rise of vernacular literature all owe something to this machine. Printers "
    "became publishers, booksellers and editors at once; their shops were meeting places for "
    "authors, translators and the curious. Over the following centuries the technique changed "
    "little, until steam power, rotary presses and later offset lithography turned printing "
    "into an industry that could produce newspapers by the hundred thousand every night."
)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(the GGUF, its float32 conversion, the first 256 tokens of TEXT)."""
    path = gemma3_gguf()
    reference = convert_gguf_to_hf(path, tmp_path_factory.mktemp("gemma3") / "hf",
                                   progress=False)
    ids = AutoTokenizer.from_pretrained(reference)(TEXT + " " + TEXT).input_ids[:256]
    assert len(ids) == 256
    return path, reference, ids


def test_float32_logprobs_equal_transformers_on_the_dequantized_weights(gemma3, tmp_path,
                                                                       monkeypatch):
    path, reference_dir, ids = gemma3
    reference = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = reference(torch.tensor([ids])).logits[0].float()
    expected = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    greedy = reference.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    del reference
    monkeypatch.setenv("RADIXLM_CACHE", str(tmp_path))
    engine = radixlm.Engine(str(path), dtype="float32", max_total_tokens=4096,
                            chunked_prefill_step_ms=None)
    try:
        out = engine.generate(input_ids=ids, return_logprob=True, logprob_start_len=0,
                              sampling_params={"max_new_tokens": 8, "temperature": 0.0,
                                               "ignore_eos": True})
    finally:
        engine.shutdown()
    got = torch.tensor([entry[0] for entry in out["meta_info"]["input_token_logprobs"][1:]])
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=0)
    assert out["output_ids"] == greedy
