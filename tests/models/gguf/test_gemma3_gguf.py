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


def test_a_4096_token_sequence_holds_local_kv_only_inside_the_window(gemma3, tmp_path,
                                                                    monkeypatch):
    """A 4,000-token prompt and 96 new tokens, no prefix cache: between steps the sliding
    layers hold at most a window and a page of KV (the global layers all 4,096 tokens)."""
    path, _, ids = gemma3
    monkeypatch.setenv("RADIXLM_CACHE", str(tmp_path))
    engine = radixlm.Engine(str(path), dtype="float32", max_total_tokens=8192, page_size=16,
                            disable_radix_cache=True)
    prompt = (ids * 16)[:4000]
    try:
        out = engine.generate(input_ids=prompt, sampling_params={
            "max_new_tokens": 96, "temperature": 0.0, "ignore_eos": True})
        info = engine.get_server_info()["sliding_window_kv"]
    finally:
        engine.shutdown()
    assert len(out["output_ids"]) == 96 and info["window"] == 512
    assert info["peak_local_in_use"] <= 512 + 16, info
    assert info["freed_local_slots"] >= 4096 - 512 - 16, info


def test_radix_hits_after_the_window_equal_a_cold_run(gemma3, tmp_path, monkeypatch):
    """Three turns of a conversation (about 4,100 tokens): each turn's cached prefix ends
    past the window; the last turn's output equals a cold run's, and the local KV the cache
    keeps is all evictable once the engine is idle."""
    path, _, ids = gemma3
    monkeypatch.setenv("RADIXLM_CACHE", str(tmp_path))
    engine = radixlm.Engine(str(path), dtype="float32", max_total_tokens=16384,
                            chunked_prefill_step_ms=None, page_size=16)
    params = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    try:
        conversation: list[int] = []
        for turn in range(3):
            conversation += ids + [(7 + 37 * turn + i * 11) % 200000 + 1000 for i in range(1102)]
            out = engine.generate(input_ids=conversation, sampling_params=params,
                                  return_logprob=True)
            assert out["meta_info"]["cached_tokens"] >= (len(conversation) - 1400 if turn
                                                         else 0)
            conversation += out["output_ids"]
        info = engine.get_server_info()["sliding_window_kv"]
        engine.flush_cache()
        cold = engine.generate(input_ids=conversation[: -len(out["output_ids"])],
                               sampling_params=params, return_logprob=True)
    finally:
        engine.shutdown()
    assert len(conversation) >= 4096
    held = info["local_kv_tokens"] - info["free_local_kv_tokens"]
    assert held == info["cache_local_evictable_tokens"], info
    assert cold["output_ids"] == out["output_ids"]
    got = torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]])
    want = torch.tensor([e[0] for e in cold["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
