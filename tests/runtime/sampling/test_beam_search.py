"""The beam search's choices (``sampling/beam_search.py``) on their own, without the runtime:
driven by a transformers model's logits (each beam's whole sequence recomputed every step),
they must give transformers' own ``generate(num_beams=...)`` outputs and scores, for every
``early_stopping`` and several length penalties, EOS sets and ``min_new_tokens``; and the
search's invariants hold on made-up logits."""

from __future__ import annotations

import pytest
import torch
from tiny_models import reference_model

from radixlm.runtime.sampling.beam_search import BeamSearch


@torch.inference_mode()
def search_with(model, prompt: list[int], search: BeamSearch) -> list:
    """Runs ``search`` to its end on ``model``'s next-token logits; returns its results."""
    while not search.done:
        sequences = torch.tensor([prompt + beam for beam in search.beams])
        logits = model(sequences).logits[:, -1].float()
        search.step(torch.log_softmax(logits, dim=-1))
    return search.results()


@torch.inference_mode()
def transformers_beams(model, prompt: list[int], width: int, max_new_tokens: int,
                       eos: list[int], **options) -> tuple[list[list[int]], list[float]]:
    out = model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
                         do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos,
                         pad_token_id=eos[0], return_dict_in_generate=True,
                         output_scores=True, **options)
    outputs = []
    for row in out.sequences[:, len(prompt):].tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in eos), len(row))
        outputs.append(row[:end])
    return outputs, out.sequences_scores.tolist()


# (width, length_penalty, early_stopping, EOS tokens, min_new_tokens)
CASES = [
    (2, 1.0, False, [0], 0),
    (4, 1.0, True, list(range(20, 80)), 0),
    (4, 0.0, "never", list(range(20, 80)), 0),
    (3, 2.0, "never", list(range(30, 90)), 0),
    (2, 1.0, "never", list(range(10, 200)), 0),
    (4, -0.5, False, list(range(20, 80)), 0),
    (5, 1.0, False, list(range(20, 80)), 3),
    (8, 1.0, True, list(range(40, 120)), 0),
]


@pytest.mark.parametrize("width,length_penalty,early_stopping,eos,min_new_tokens", CASES)
def test_choices_equal_transformers(tiny_model_dir, width, length_penalty, early_stopping,
                                    eos, min_new_tokens):
    """Tokens equal, scores within 1e-4, best first; EOS sets wide enough that beams end
    early, so the finished-hypothesis rules (early stopping, the heuristic) all act."""
    model = reference_model(tiny_model_dir("LlamaForCausalLM"))
    generator = torch.Generator().manual_seed(width * 100 + min_new_tokens)
    for _ in range(2):
        prompt = torch.randint(3, 300, (12,), generator=generator).tolist()
        options = dict(length_penalty=length_penalty, early_stopping=early_stopping)
        if min_new_tokens:
            options["min_new_tokens"] = min_new_tokens
        expected, scores = transformers_beams(model, prompt, width, 10, eos, **options)
        search = BeamSearch(width, 10, frozenset(eos), length_penalty, early_stopping,
                            min_new_tokens)
        results = search_with(model, prompt, search)
        assert [h.tokens for h in results] == expected
        assert [h.score for h in results] == pytest.approx(scores, abs=1e-4)
        for hypothesis in results:
            assert len(hypothesis.tokens) >= min(min_new_tokens + 1, 10)
            assert hypothesis.score == pytest.approx(
                hypothesis.cumulative_logprob / len(hypothesis.tokens) ** length_penalty)


def test_width_one_is_greedy():
    """One beam follows the argmax; it ends at the budget or its EOS."""
    torch.manual_seed(0)
    logits = [torch.randn(1, 50) for _ in range(6)]
    search = BeamSearch(1, 6, frozenset({7}))
    for step in logits:
        if search.done:
            break
        search.step(torch.log_softmax(step, dim=-1))
    expected = []
    for step in logits:
        expected.append(int(step.argmax()))
        if expected[-1] == 7:
            break
    assert search.results()[0].tokens == expected


def test_early_stopping_true_ends_once_width_hypotheses_finish():
    """EOS is each beam's best token from the second step: with ``early_stopping=True`` the
    search ends as soon as ``width`` hypotheses have finished, well before the budget."""
    width, vocab, eos = 3, 20, 5
    search = BeamSearch(width, 50, frozenset({eos}), early_stopping=True)
    steps = 0
    while not search.done:
        logits = torch.arange(vocab, dtype=torch.float32).repeat(len(search.beams), 1)
        if steps:
            logits[:, eos] = 100.0
        search.step(torch.log_softmax(logits, dim=-1))
        steps += 1
    results = search.results()
    assert len(results) == width and steps < 50
    assert all(h.tokens[-1] == eos for h in results)
    assert [h.score for h in results] == sorted((h.score for h in results), reverse=True)


def test_reset_starts_over():
    """A retracted search starts again from the prompt and repeats itself."""
    torch.manual_seed(1)
    logits = [torch.log_softmax(torch.randn(4, 30), dim=-1) for _ in range(5)]
    search = BeamSearch(4, 5, frozenset())
    runs = []
    for _ in range(2):
        search.reset()
        step = 0
        while not search.done:
            search.step(logits[step][: len(search.beams)])
            step += 1
        runs.append([(h.tokens, h.score) for h in search.results()])
    assert runs[0] == runs[1] and len(runs[0]) == 4


def test_invalid_early_stopping_is_refused():
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearch(2, 4, frozenset(), early_stopping="sometimes")
