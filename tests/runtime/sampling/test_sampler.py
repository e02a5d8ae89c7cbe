"""The Sampler against naive references on hand-made logits.

Distributions are checked empirically: one ``sample`` call over a batch of identical rows
draws thousands of tokens at once. The sampler's generator is seeded, so every test is
deterministic.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from fused_kernels import enable_or_skip
from tiny_models import tiny_tokenizer

from radixlm.kernels.cpu_ops import fused_ops
from radixlm.runtime.detokenizer.incremental_detokenizer import IncrementalDetokenizer
from radixlm.runtime.request import Req
from radixlm.runtime.sampling.sampler import Sampler
from radixlm.runtime.sampling.sampling_params import SamplingParams

VOCAB = 8
EOS = 7
DRAWS = 4000


def make_req(input_ids=(1, 2, 3), output_ids=(), **params) -> Req:
    req = Req(
        rid="r",
        input_ids=list(input_ids),
        sampling=SamplingParams.from_dict(params),
        detokenizer=IncrementalDetokenizer(tiny_tokenizer(), list(input_ids)),
    )
    req.output_ids = list(output_ids)
    return req


def sample(sampler: Sampler, logits: torch.Tensor, reqs: list[Req]) -> list[int]:
    """``sampler``'s tokens for ``reqs`` (a fresh sampling batch of them) as a list."""
    batch = sampler.new_batch(logits.device)
    batch.add(reqs)
    return sampler.sample(logits, batch).tolist()


def process(logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
    """``logits`` after bias, penalties and the min_new_tokens ban of ``reqs``."""
    sampler = Sampler(VOCAB, {EOS}, 0)
    batch = sampler.new_batch(logits.device)
    batch.add(reqs)
    return sampler.process_logits(logits, batch)


def logits_of(probs: list[float]) -> torch.Tensor:
    """Logits over VOCAB tokens whose softmax is ``probs`` on the first ids and 0 elsewhere."""
    row = torch.full((VOCAB,), float("-inf"))
    row[: len(probs)] = torch.log(torch.tensor(probs))
    return row


def draw(row: torch.Tensor, req: Req, draws: int = DRAWS, seed: int = 0) -> torch.Tensor:
    """Token counts (VOCAB,) of ``draws`` samples of ``row`` under ``req``'s settings."""
    sampler = Sampler(VOCAB, {EOS}, seed)
    copies = [copy.copy(req) for _ in range(draws)]  # one row each
    tokens = sample(sampler, row[None].expand(draws, -1).clone(), copies)
    return torch.bincount(torch.tensor(tokens), minlength=VOCAB)


def support(counts: torch.Tensor) -> set[int]:
    return set(torch.nonzero(counts)[:, 0].tolist())


def test_top_k_1_equals_greedy_on_random_logits():
    torch.manual_seed(0)
    logits = torch.randn(64, VOCAB) * 3
    reqs = [make_req(temperature=1.5, top_k=1) for _ in range(64)]
    assert sample(Sampler(VOCAB, {EOS}, 0), logits.clone(), reqs) == logits.argmax(-1).tolist()


def test_greedy_rows_take_the_argmax_even_next_to_sampled_rows():
    torch.manual_seed(1)
    logits = torch.randn(16, VOCAB) * 3
    reqs = [make_req(temperature=0.0 if i % 2 else 1.0) for i in range(16)]
    tokens = sample(Sampler(VOCAB, {EOS}, 0), logits.clone(), reqs)
    assert tokens[1::2] == logits.argmax(-1)[1::2].tolist()


FIVE = [0.4, 0.3, 0.15, 0.1, 0.05]


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.3, {0}), (0.5, {0, 1}), (0.8, {0, 1, 2}), (0.9, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3, 4})],
)
def test_top_p_keeps_the_smallest_set_whose_mass_reaches_p(top_p, kept):
    counts = draw(logits_of(FIVE), make_req(top_p=top_p))
    assert support(counts) == kept
    # Within the kept set, the draws follow the renormalised probabilities.
    mass = sum(FIVE[i] for i in kept)
    for token in kept:
        assert counts[token] / DRAWS == pytest.approx(FIVE[token] / mass, abs=0.035)


@pytest.mark.parametrize(
    ("top_k", "kept"), [(1, {0}), (2, {0, 1}), (4, {0, 1, 2, 3}), (-1, {0, 1, 2, 3, 4})]
)
def test_top_k_keeps_the_k_most_likely(top_k, kept):
    assert support(draw(logits_of(FIVE), make_req(top_k=top_k))) == kept


MIN_P_PROBS = [0.5, 0.2, 0.15, 0.1, 0.05]


@pytest.mark.parametrize(
    ("min_p", "kept"), [(0.0, {0, 1, 2, 3, 4}), (0.15, {0, 1, 2, 3}), (0.25, {0, 1, 2}),
                        (0.35, {0, 1}), (0.9, {0})],
)
def test_min_p_removes_tokens_below_min_p_times_the_max(min_p, kept):
    assert support(draw(logits_of(MIN_P_PROBS), make_req(min_p=min_p))) == kept


def test_top_k_and_top_p_combine_as_the_intersection():
    assert support(draw(logits_of(FIVE), make_req(top_k=2, top_p=0.8))) == {0, 1}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sampled_frequencies_follow_softmax_of_logits_over_temperature(temperature):
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -1.5, -2.0, -3.0])
    counts = draw(row, make_req(temperature=temperature))
    expected = torch.softmax(row / temperature, dim=-1)
    torch.testing.assert_close(counts / DRAWS, expected, atol=0.035, rtol=0)


def test_draws_skip_tokens_without_mass_wherever_they_lie():
    row = torch.full((VOCAB,), float("-inf"))  # mass on the first and last ids only
    row[0], row[VOCAB - 1] = 0.0, math.log(3.0)
    counts = draw(row, make_req())
    assert support(counts) == {0, VOCAB - 1}
    assert abs(counts[VOCAB - 1] / DRAWS - 0.75) < 0.03


def test_lower_temperature_sharpens_the_distribution():
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -1.5, -2.0, -3.0])
    top_share = [int(draw(row, make_req(temperature=t))[0]) for t in (2.0, 1.0, 0.5, 0.25)]
    assert top_share == sorted(top_share) and top_share[0] < top_share[-1]


def naive_penalised(logits, input_ids, output_ids, repetition, frequency, presence):
    """Repetition over prompt + output (divide positives, multiply negatives), then
    frequency * count and presence * (count > 0) over the output only."""
    out = logits.clone()
    for token in set(input_ids) | set(output_ids):
        value = float(logits[token])
        out[token] = value / repetition if value > 0 else value * repetition
    for token in set(output_ids):
        out[token] -= frequency * output_ids.count(token) + presence
    return out


PENALTIES = [
    (2.0, 0.0, 0.0),
    (0.5, 0.0, 0.0),
    (1.0, 0.5, 0.0),
    (1.0, 0.0, 0.75),
    (1.0, -0.5, -0.25),
    (1.3, 0.4, 0.2),
]


@pytest.mark.parametrize(("repetition", "frequency", "presence"), PENALTIES)
def test_penalties_change_exactly_the_expected_logits(repetition, frequency, presence):
    logits = torch.tensor([[1.5, -0.5, 2.0, -1.0, 0.25, 3.0, -2.0, 0.0]])
    input_ids, output_ids = [0, 1, 1], [1, 3, 3, 4]
    req = make_req(input_ids, output_ids, repetition_penalty=repetition,
                   frequency_penalty=frequency, presence_penalty=presence)
    got = process(logits.clone(), [req])[0]
    expected = naive_penalised(logits[0], input_ids, output_ids, repetition, frequency, presence)
    torch.testing.assert_close(got, expected)


def test_frequency_and_presence_penalties_ignore_the_prompt_before_any_output():
    logits = torch.tensor([[1.5, -0.5, 2.0, -1.0, 0.25, 3.0, -2.0, 0.0]])
    req = make_req([0, 1, 2], [], frequency_penalty=1.0, presence_penalty=1.0)
    got = process(logits.clone(), [req])
    torch.testing.assert_close(got, logits)


@pytest.mark.parametrize("bias", [{"2": 5.0, "5": -3.0}, {2: 5.0, 5: -3.0}])
def test_logit_bias_adds_to_the_named_tokens_only(bias):
    logits = torch.zeros(2, VOCAB)
    reqs = [make_req(logit_bias=bias), make_req()]
    got = process(logits.clone(), reqs)
    expected = torch.zeros(2, VOCAB)
    expected[0, 2], expected[0, 5] = 5.0, -3.0
    torch.testing.assert_close(got, expected)


def test_logit_bias_can_force_a_token_under_greedy():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    req = make_req(temperature=0.0, logit_bias={"6": 10.0})
    assert sample(Sampler(VOCAB, {EOS}, 0), logits, [req]) == [6]


@pytest.mark.parametrize(
    ("outputs", "ignore_eos", "banned"),
    [
        (0, False, {EOS, 4, 5}),
        (2, False, {EOS, 4, 5}),
        (2, True, {4, 5}),
        (3, False, set()),
        (5, False, set()),
    ],
)
def test_min_new_tokens_bans_eos_and_stop_token_ids_until_reached(outputs, ignore_eos, banned):
    logits = torch.zeros(1, VOCAB)
    req = make_req(output_ids=[1] * outputs, min_new_tokens=3, stop_token_ids=[4, 5],
                   ignore_eos=ignore_eos)
    got = process(logits.clone(), [req])[0]
    assert {i for i in range(VOCAB) if math.isinf(got[i])} == banned
    assert all(got[i] == 0 for i in range(VOCAB) if i not in banned)


def test_min_new_tokens_makes_a_sampled_eos_impossible():
    row = logits_of([0.01] * 7 + [0.93])  # EOS (id 7) is by far the most likely
    counts = draw(row, make_req(min_new_tokens=1), draws=500)
    assert counts[EOS] == 0 and counts.sum() == 500


def test_sampling_seed_gives_the_same_tokens_across_samplers():
    torch.manual_seed(2)
    logits = torch.randn(1, VOCAB)
    tokens = []
    for global_seed in (0, 1, 2):
        sampler = Sampler(VOCAB, {EOS}, global_seed)
        row = []
        for step in range(20):
            row += sample(sampler, logits.clone(), [make_req(output_ids=[1] * step,
                                                             sampling_seed=1234)])
        tokens.append(row)
    assert tokens[0] == tokens[1] == tokens[2]
    assert len(set(tokens[0])) > 1  # the draws vary by position, not one repeated token


def test_different_sampling_seeds_give_different_tokens():
    logits = torch.zeros(1, VOCAB)
    sampler = Sampler(VOCAB, {EOS}, 0)
    runs = [
        [sample(sampler, logits.clone(), [make_req(output_ids=[1] * step, sampling_seed=seed)])[0]
         for step in range(20)]
        for seed in (1, 2)
    ]
    assert runs[0] != runs[1]


def test_sampling_seed_is_independent_of_the_batch_composition():
    torch.manual_seed(3)
    logits = torch.randn(5, VOCAB) * 2
    seeded = make_req(output_ids=[1, 2], sampling_seed=77, temperature=0.8, top_p=0.9)
    alone = sample(Sampler(VOCAB, {EOS}, 0), logits[2:3].clone(), [seeded])
    others = [make_req(), make_req(temperature=0.0), make_req(sampling_seed=5), make_req(top_k=2)]
    for position in range(5):
        batch = others[:position] + [seeded] + others[position:]
        rows = torch.cat([logits[:position], logits[2:3], logits[position:4]])
        got = sample(Sampler(VOCAB, {EOS}, position + 10), rows.clone(), batch)
        assert got[position] == alone[0]


def test_seeded_draws_follow_the_distribution():
    row = torch.tensor([1.0, 0.0, -1.0, -2.0, -9.0, -9.0, -9.0, -9.0])
    sampler = Sampler(VOCAB, {EOS}, 0)
    tokens = [
        sample(sampler, row[None].clone(), [make_req(output_ids=[1] * step, sampling_seed=seed)])[0]
        for seed in range(40) for step in range(25)
    ]
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB) / len(tokens)
    torch.testing.assert_close(counts, torch.softmax(row, -1), atol=0.04, rtol=0)


def test_sample_ignores_logit_columns_past_the_vocabulary():
    logits = torch.zeros(1, VOCAB + 4)
    logits[0, VOCAB + 1] = 100.0  # padding column of a padded LM head
    logits[0, 3] = 5.0
    assert sample(Sampler(VOCAB, {EOS}, 0), logits, [make_req(temperature=0.0)]) == [3]


def test_a_row_without_top_k_or_top_p_keeps_its_tail_when_another_row_sorts():
    """The mass before token 2 rounds to 1.0 in float32; a row that asked for no top-p keeps
    token 2 anyway, so a seeded row's draws cannot depend on its neighbours' settings."""
    from radixlm.runtime.sampling.sampler import _filter_probs

    probs = torch.tensor([[0.6, 0.4000001, 1e-7, 0.0, 0.0, 0.0, 0.0, 0.0]] * 2)
    sampler = Sampler(VOCAB, {EOS}, 0)
    batch = sampler.new_batch("cpu")
    batch.add([make_req(temperature=1.0), make_req(temperature=1.0, top_k=2)])
    filtered = _filter_probs(probs, batch)
    assert torch.equal(filtered[0], probs[0])
    assert filtered[1].tolist()[2:] == [0.0] * 6


def _kept_by_full_sort(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """One row (V,) filtered by a plain loop over its tokens, most likely first."""
    kept, mass = torch.zeros_like(probs), 0.0
    for rank, token in enumerate(probs.argsort(descending=True, stable=True).tolist()):
        if (top_k > 0 and rank >= top_k) or mass >= top_p:
            break
        kept[token] = probs[token]
        mass += float(probs[token])
    return kept


@pytest.mark.parametrize("case", ["within the candidates", "beyond them"])
def test_top_k_top_p_over_a_large_vocabulary_equal_the_full_ranking(case):
    """With more tokens than TOP_CANDIDATES the CPU path ranks a few candidates first; what
    it keeps is what ranking every token keeps, whether the kept tokens lie among the
    candidates (a peaked row, small top_k, a row without limits) or not (a flat row's top_p,
    a top_k beyond them, which then rank every token)."""
    from radixlm.runtime.sampling.sampler import TOP_CANDIDATES, _filter_probs

    vocab = 4 * TOP_CANDIDATES
    torch.manual_seed(0)
    peaked = torch.softmax(torch.randn(vocab) * 4, dim=-1)
    flat = torch.softmax(torch.randn(vocab) * 0.1, dim=-1)
    rows = {"within the candidates": [(peaked, -1, 0.9), (flat, 5, 1.0), (flat, -1, 1.0),
                                      (peaked, 40, 0.5)],
            "beyond them": [(peaked, -1, 0.9), (flat, -1, 0.9), (peaked, TOP_CANDIDATES + 9, 1.0),
                            (flat, -1, 1.0)]}[case]
    sampler = Sampler(vocab, {EOS}, 0)
    batch = sampler.new_batch("cpu")
    batch.add([make_req(temperature=1.0, top_k=k, top_p=p) for _, k, p in rows])
    filtered = _filter_probs(torch.stack([row for row, _, _ in rows]), batch)
    for got, (row, top_k, top_p) in zip(filtered, rows):
        expected = row if (top_k < 0 and top_p >= 1.0) else _kept_by_full_sort(row, top_k, top_p)
        assert torch.equal(got != 0, expected != 0)
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
    if case == "beyond them":  # the flat row's top_p reaches past the candidates
        assert int((filtered[1] != 0).sum()) > TOP_CANDIDATES


def test_greedy_rows_with_the_fused_cpu_kernels_on_are_torch_argmax(monkeypatch):
    """On a CPU the kernels' vectorised argmax serves greedy rows: the same tokens (ties go
    to the first), plain greedy and greedy beside sampled rows."""
    was_on = fused_ops.active() is not None
    kernels, calls = enable_or_skip(), []

    def observed_argmax(x):
        calls.append(x.shape[0])
        return kernels.argmax_rows(x)

    monkeypatch.setattr(fused_ops, "_module", SimpleNamespace(argmax_rows=observed_argmax))
    try:
        logits = torch.randn(6, VOCAB + 3).round()  # ties; columns past the vocabulary
        logits[2, VOCAB + 1] = 1e9  # outside the vocabulary: never picked
        want = logits[:, :VOCAB].argmax(-1).tolist()
        greedy = [make_req(temperature=0.0) for _ in range(6)]
        assert sample(Sampler(VOCAB, {EOS}, 0), logits.clone(), greedy) == want
        mixed = greedy[:3] + [make_req(temperature=1.0, sampling_seed=1) for _ in range(3)]
        assert sample(Sampler(VOCAB, {EOS}, 0), logits.clone(), mixed)[:3] == want[:3]
        assert calls == [6, 6]  # the kernel, not torch's argmax, for both batches
    finally:
        monkeypatch.undo()  # the real module back, before it may be turned off
        if not was_on:
            fused_ops.disable()
