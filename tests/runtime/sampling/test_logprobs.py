"""Logprobs returned by Engine.generate: output, top-k and prompt logprobs in the native shape
``[logprob, token_id, text_or_None]``, with SGLang's ``logprob_start_len`` semantics."""

from __future__ import annotations

import pytest
import torch
from tiny_models import VOCAB_SIZE
from workloads import PROMPTS, greedy, sampled

from radixlm.runtime.sampling.logprobs import LogprobCopy, Logprobs


def test_output_token_logprobs_have_one_entry_per_output_token(engine_for):
    out = engine_for().generate(PROMPTS[1], greedy(10), return_logprob=True)
    meta = out["meta_info"]
    entries = meta["output_token_logprobs"]
    assert len(entries) == len(out["output_ids"]) == 10
    assert [e[1] for e in entries] == out["output_ids"]
    assert all(isinstance(e[0], float) and e[0] <= 0.0 and e[2] is None for e in entries)
    assert meta["input_token_logprobs"] == []  # logprob_start_len defaults to output only
    assert "output_top_logprobs" not in meta


def test_top_logprobs_are_sorted_and_greedy_picks_the_top_one(engine_for):
    out = engine_for().generate(PROMPTS[1], greedy(10), return_logprob=True, top_logprobs_num=3)
    meta = out["meta_info"]
    tops = meta["output_top_logprobs"]
    assert len(tops) == 10
    for entry, top in zip(meta["output_token_logprobs"], tops, strict=True):
        assert len(top) == 3
        values = [t[0] for t in top]
        assert values == sorted(values, reverse=True)
        assert top[0][1] == entry[1]
        assert top[0][0] == pytest.approx(entry[0], abs=1e-6)
        assert len({t[1] for t in top}) == 3


def test_sampled_tokens_report_their_own_logprob_among_the_top(engine_for):
    out = engine_for().generate(PROMPTS[1], sampled(3, 12), return_logprob=True,
                                top_logprobs_num=5)
    meta = out["meta_info"]
    for entry, top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"],
                          strict=True):
        listed = {t[1]: t[0] for t in top}
        if entry[1] in listed:
            assert listed[entry[1]] == pytest.approx(entry[0], abs=1e-6)
        else:
            assert entry[0] <= top[-1][0] + 1e-6


def test_return_text_in_logprobs_gives_token_texts(engine_for):
    engine = engine_for()
    out = engine.generate(PROMPTS[1], greedy(6), return_logprob=True, logprob_start_len=0,
                          top_logprobs_num=2, return_text_in_logprobs=True)
    meta = out["meta_info"]
    for entry in meta["output_token_logprobs"] + meta["input_token_logprobs"]:
        assert entry[2] == engine.tokenizer.decode([entry[1]])
    for top in meta["output_top_logprobs"]:
        assert all(isinstance(t[2], str) for t in top)


@pytest.mark.parametrize("start", [0, 1, 3, -1])
def test_input_token_logprobs_follow_sglang_logprob_start_len(engine_for, start):
    """As SGLang: start s > 0 returns prompt tokens s + 1 .. L - 1 (from the logits at
    positions s .. L - 2); s = 0 returns every prompt token, the first with a null logprob;
    -1 returns none. (SGLang's ``select`` relies on this with s = prompt_tokens - 2.)"""
    engine = engine_for()
    prompt_ids = engine.tokenizer.encode(PROMPTS[3])
    reference = engine.generate(input_ids=prompt_ids, sampling_params=greedy(2),
                                return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    out = engine.generate(input_ids=prompt_ids, sampling_params=greedy(2), return_logprob=True,
                          logprob_start_len=start, top_logprobs_num=2)
    meta = out["meta_info"]
    if start == -1:
        assert meta["input_token_logprobs"] == []
        return
    first = 0 if start == 0 else start + 1
    assert [e[1] for e in meta["input_token_logprobs"]] == prompt_ids[first:]
    assert len(meta["input_top_logprobs"]) == len(prompt_ids) - first
    assert (meta["input_token_logprobs"][0][0] is None) == (start == 0)
    expected = [e[0] for e in reference["meta_info"]["input_token_logprobs"][first:]]
    got = [e[0] for e in meta["input_token_logprobs"]]
    assert got == pytest.approx(expected, abs=1e-5)


def test_prompt_logprobs_of_a_batch_match_each_prompt_alone(engine_for):
    engine = engine_for()
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    batch = engine.generate(input_ids=ids, sampling_params=greedy(3), return_logprob=True,
                            logprob_start_len=0)
    for prompt_ids, out in zip(ids, batch, strict=True):
        alone = engine.generate(input_ids=prompt_ids, sampling_params=greedy(3),
                                return_logprob=True, logprob_start_len=0)
        got = [e[0] for e in out["meta_info"]["input_token_logprobs"][1:]]
        want = [e[0] for e in alone["meta_info"]["input_token_logprobs"][1:]]
        assert got == pytest.approx(want, abs=1e-5)


def test_frequency_and_presence_penalties_steer_greedy_by_output_counts(engine_for):
    """Penalties shift logits by a per-token constant, so greedy must pick the argmax of the
    raw logprobs (reported before penalties) minus the penalties of the output so far."""
    engine = engine_for(max_logprobs=VOCAB_SIZE)  # every token's logprob, past the default cap
    vocab = engine.model_config.vocab_size
    params = greedy(16, frequency_penalty=1.5, presence_penalty=0.5)
    out = engine.generate(PROMPTS[0], params, return_logprob=True, top_logprobs_num=vocab)
    plain = engine.generate(PROMPTS[0], greedy(16))
    assert out["output_ids"] != plain["output_ids"]  # the penalties mattered here
    counts: dict[int, int] = {}
    for token, top in zip(out["output_ids"], out["meta_info"]["output_top_logprobs"],
                          strict=True):
        scores = {
            t[1]: t[0] - 1.5 * counts.get(t[1], 0) - 0.5 * (t[1] in counts) for t in top
        }
        assert token == max(scores, key=scores.get)
        counts[token] = counts.get(token, 0) + 1



def test_a_started_copy_reads_what_compute_gives_after_its_logits_change():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor([3, 0, 39, 7, 7])
    expected = Logprobs.compute(logits, tokens, 3)
    copy = LogprobCopy.start(logits, tokens, top_k=3)
    logits.fill_(0.0)  # the copy holds its own result: later writes do not reach it
    found = copy.read()
    assert found == expected and found.token_ids == tokens.tolist()
