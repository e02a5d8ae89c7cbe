"""The three choice methods' arithmetic, on logprobs chosen so that each method decides
differently."""

from __future__ import annotations

import pytest

from radixlm.frontend_lang.choices import (
    ChoiceScores,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)


def test_token_length_normalized_picks_the_highest_mean_token_logprob():
    scores = ChoiceScores(["short", "long"], [[-2.0], [-0.5, -0.5, -3.2]])
    decision = token_length_normalized(scores)
    # means: -2.0 and -1.4; the longer choice has the lower total but the higher mean.
    assert decision.decision == "long"
    assert decision.meta_info["normalized_prompt_logprobs"] == pytest.approx([-2.0, -1.4])


def test_greedy_token_selection_compares_token_by_token_and_pads_with_the_mean():
    # Position 0 ties between a and b (c drops out); at position 1 b's -0.1 beats a's -0.2,
    # although a has the higher mean (-0.6 vs -1.05).
    scores = ChoiceScores(["a", "b", "c"], [[-1.0, -0.2], [-1.0, -0.1, -2.0], [-1.5, 0.0]])
    decision = greedy_token_selection(scores)
    assert decision.decision == "b"
    matrix = decision.meta_info["greedy_logprob_matrix"]
    assert matrix[0] == pytest.approx([-1.0, -0.2, -0.6])  # padded with its own mean
    assert matrix[2] == pytest.approx([-1.5, 0.0, -0.75])
    assert token_length_normalized(scores).decision == "a"  # means: -0.6, -1.033, -0.75


def test_greedy_token_selection_lets_a_prefix_win_with_its_mean():
    # "yes" (one token, -0.3) against "yes sir" (-0.3, -0.9): at position 1 "yes" is padded
    # with its mean -0.3, which beats -0.9.
    scores = ChoiceScores(["yes", "yes sir"], [[-0.3], [-0.3, -0.9]])
    assert greedy_token_selection(scores).decision == "yes"


def test_unconditional_likelihood_normalized_discounts_what_is_likely_anyway():
    scores = ChoiceScores(["the", "Paris"], [[-0.5], [-1.0, -0.4]],
                          unconditional=[[0.0], [0.0, -3.0]])
    decision = unconditional_likelihood_normalized(scores)
    # conditional minus unconditional, averaged: the: -0.5; Paris: (-1.0 + 2.6) / 2 = 0.8.
    assert decision.decision == "Paris"
    assert decision.meta_info["normalized_unconditional_prompt_logprobs"] == pytest.approx(
        [-0.5, 0.8])
    assert token_length_normalized(scores).decision == "the"


def test_ties_go_to_the_first_choice():
    scores = ChoiceScores(["x", "y"], [[-1.0], [-1.0]], unconditional=[[0.0], [0.0]])
    for method in (token_length_normalized, greedy_token_selection,
                   unconditional_likelihood_normalized):
        assert method(scores).decision == "x"


def test_bad_scores_are_refused():
    with pytest.raises(ValueError, match="no tokens"):
        ChoiceScores(["x", "y"], [[-1.0], []])
    with pytest.raises(ValueError, match="one list"):
        ChoiceScores(["x"], [[-1.0], [-2.0]])
    with pytest.raises(ValueError, match="unconditional"):
        unconditional_likelihood_normalized(ChoiceScores(["x"], [[-1.0]]))
