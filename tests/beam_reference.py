"""transformers' beam search on a tiny model, as the reference for radixlm's ``use_beam_search``
(tests/runtime/scheduler/test_beam_groups.py and test_beam_search_scheduling.py, the HTTP
tests): the k hypotheses best first, each cut after its first EOS token, with their
``sequences_scores``."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import reference_model

SETTINGS = [(1.0, False), (0.0, "never"), (2.0, True), (-0.5, False)]
"""(length_penalty, early_stopping) pairs: the default, the canonical search, a strong
preference for long outputs that ends as soon as k are done, and one for short outputs."""


def beam(width: int, max_new_tokens: int, length_penalty: float = 1.0,
         early_stopping: bool | str = False, **extra) -> dict:
    """The sampling parameters of a beam search of ``width``."""
    return {"use_beam_search": True, "n": width, "max_new_tokens": max_new_tokens,
            "length_penalty": length_penalty, "early_stopping": early_stopping, **extra}


def cut_after_eos(tokens: list[int], eos_ids: list[int]) -> list[int]:
    """``tokens`` up to and including the first EOS (transformers pads after it)."""
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: i + 1]
    return tokens


@torch.inference_mode()
def sequence_logprob(directory: Path, input_ids: list[int], tokens: list[int]) -> float:
    """The sum of log p(token | everything before it) over ``tokens``, from one forward pass
    of transformers over the prompt and the tokens."""
    model = reference_model(directory)
    ids = torch.tensor([input_ids + tokens])
    logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    # The logits at position i predict token i + 1.
    positions = torch.arange(len(input_ids) - 1, len(input_ids) + len(tokens) - 1)
    return float(logprobs[positions, torch.tensor(tokens)].sum())


@torch.inference_mode()
def reference_beams(directory: Path, input_ids: list[int], width: int, max_new_tokens: int,
                    length_penalty: float, early_stopping: bool | str,
                    eos_ids: list[int]) -> list[tuple[list[int], float]]:
    """transformers' ``width`` best hypotheses as (tokens, sequences_score), best first.

    transformers runs ``num_beams=1`` as greedy search, which reports no score: there the
    score is computed from the greedy tokens' summed logprob, normalised the same way.
    """
    model = reference_model(directory)
    prompt = torch.tensor([input_ids])
    common = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                  do_sample=False, eos_token_id=list(eos_ids), pad_token_id=eos_ids[0],
                  return_dict_in_generate=True)
    if width == 1:
        out = model.generate(prompt, num_beams=1, **common)
        tokens = cut_after_eos(out.sequences[0, len(input_ids):].tolist(), eos_ids)
        total = sequence_logprob(directory, input_ids, tokens)
        return [(tokens, total / len(tokens) ** length_penalty)]
    out = model.generate(prompt, num_beams=width, num_return_sequences=width,
                         length_penalty=length_penalty, early_stopping=early_stopping,
                         output_scores=True, **common)
    return [(cut_after_eos(row.tolist(), eos_ids), float(score))
            for row, score in zip(out.sequences[:, len(input_ids):], out.sequences_scores)]


def frequent_stop_ids(directory: Path, input_ids: list[int], width: int,
                      max_new_tokens: int, length_penalty: float, early_stopping: bool | str,
                      model_eos: int) -> list[int]:
    """Two stop tokens on which some of the same search's hypotheses end (random tiny models
    rarely pick their own EOS), preferably some before the budget: tried in pairs among the
    tokens that the search, without them, puts in its hypotheses (the best one's last token
    first). Fails if no pair of the first few works."""
    found = reference_beams(directory, input_ids, width, max_new_tokens, length_penalty,
                            early_stopping, [model_eos])
    candidates = [found[0][0][-1]]
    for tokens, _ in found:
        for token in tokens[len(tokens) // 2:] + tokens[: len(tokens) // 2]:
            if token != model_eos and token not in candidates:
                candidates.append(token)
    pairs = [(a, b) for i, a in enumerate(candidates[:5]) for b in candidates[i + 1:5]]
    fallback = None
    for pair in pairs:
        eos = [*pair, model_eos]
        ended = [tokens for tokens, _ in reference_beams(
            directory, input_ids, width, max_new_tokens, length_penalty, early_stopping, eos)
            if tokens[-1] in pair]
        if any(len(tokens) < max_new_tokens for tokens in ended):
            return sorted(pair)
        if ended and fallback is None:
            fallback = sorted(pair)
    assert fallback is not None, "no pair of stop tokens ends any hypothesis"
    return fallback


def check_beams(outs: list[dict], expected: list[tuple[list[int], float]],
                length_penalty: float, eos_ids: list[int], max_new_tokens: int,
                directory: Path | None = None, input_ids: list[int] | None = None) -> int:
    """Asserts that the Engine's outputs are transformers' hypotheses, in order, with their
    scores; returns how many ended on an EOS token. With ``directory`` and ``input_ids``,
    each ``cumulative_logprob`` is also checked against a forward pass of its tokens."""
    assert [o["output_ids"] for o in outs] == [tokens for tokens, _ in expected]
    stops = 0
    for out, (tokens, score) in zip(outs, expected):
        meta = out["meta_info"]
        assert abs(meta["beam_score"] - score) < 1e-4, (meta["beam_score"], score)
        normaliser = len(tokens) ** length_penalty
        assert abs(meta["cumulative_logprob"] - meta["beam_score"] * normaliser) < (
            1e-5 * max(1.0, abs(meta["cumulative_logprob"])))
        if directory is not None:
            want = sequence_logprob(directory, input_ids, tokens)
            assert abs(meta["cumulative_logprob"] - want) < 1e-3, (meta["cumulative_logprob"],
                                                                   want)
        if tokens[-1] in eos_ids:
            assert meta["finish_reason"] == {"type": "stop", "matched": tokens[-1]}
            stops += 1
        else:
            assert meta["finish_reason"]["type"] == "length"
            assert len(tokens) == max_new_tokens
    return stops
