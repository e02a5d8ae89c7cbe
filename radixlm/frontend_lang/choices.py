"""How ``select`` turns the logprobs of each choice into a decision.

A backend scores every choice as a continuation of the state's text and hands a method the
logprob of each choice token (``ChoiceScores``). The three methods of SGLang's surface:

- ``token_length_normalized``: the highest mean token logprob.
- ``greedy_token_selection``: compare choices token by token, keeping those with the best
  logprob at each position until one is left; a choice that has run out of tokens is padded
  with its own mean logprob, so a prefix of a longer choice can still win.
- ``unconditional_likelihood_normalized``: the highest mean of (logprob given the context
  minus logprob of the choice on its own), which discounts choices that are likely anyway.

Ties go to the earliest choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ChoiceScores:
    """Per choice, the logprob of each of its tokens (at least one token per choice).

    ``unconditional[i][j]`` is token j's logprob with no context but the choice itself
    (the first has no context at all and counts as 0); only filled for methods that need it.
    """

    choices: list[str]
    token_logprobs: list[list[float]]
    unconditional: list[list[float]] | None = None
    token_ids: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.token_logprobs) != len(self.choices):
            raise ValueError("one list of token logprobs per choice is needed")
        empty = [c for c, lps in zip(self.choices, self.token_logprobs) if not lps]
        if empty:
            raise ValueError(f"choices {empty!r} have no tokens to score")

    @property
    def mean_logprobs(self) -> list[float]:
        return [sum(lps) / len(lps) for lps in self.token_logprobs]


@dataclass
class ChoicesDecision:
    """The chosen text and what the method computed on the way (for ``get_meta_info``)."""

    decision: str
    meta_info: dict[str, Any]


class ChoicesMethod:
    """A way to decide; ``needs_unconditional`` asks the backend for the extra scores."""

    needs_unconditional = False

    def __call__(self, scores: ChoiceScores) -> ChoicesDecision:
        raise NotImplementedError

    @staticmethod
    def _meta(scores: ChoiceScores, **extra: Any) -> dict[str, Any]:
        return {"normalized_prompt_logprobs": scores.mean_logprobs,
                "input_token_logprobs": scores.token_logprobs, **extra}


class TokenLengthNormalized(ChoicesMethod):
    def __call__(self, scores: ChoiceScores) -> ChoicesDecision:
        means = scores.mean_logprobs
        return ChoicesDecision(scores.choices[_argmax(means)], self._meta(scores))


class GreedyTokenSelection(ChoicesMethod):
    def __call__(self, scores: ChoiceScores) -> ChoicesDecision:
        width = max(len(lps) for lps in scores.token_logprobs)
        matrix = [lps + [mean] * (width - len(lps))
                  for lps, mean in zip(scores.token_logprobs, scores.mean_logprobs)]
        remaining = list(range(len(scores.choices)))
        for position in range(width):
            best = max(matrix[i][position] for i in remaining)
            remaining = [i for i in remaining if matrix[i][position] == best]
            if len(remaining) == 1:
                break
        return ChoicesDecision(scores.choices[remaining[0]],
                               self._meta(scores, greedy_logprob_matrix=matrix))


class UnconditionalLikelihoodNormalized(ChoicesMethod):
    needs_unconditional = True

    def __call__(self, scores: ChoiceScores) -> ChoicesDecision:
        if scores.unconditional is None:
            raise ValueError("unconditional_likelihood_normalized needs the unconditional "
                             "logprobs of every choice")
        differences = []
        for conditional, unconditional in zip(scores.token_logprobs, scores.unconditional):
            if len(conditional) != len(unconditional):
                raise ValueError("conditional and unconditional scores cover different tokens")
            terms = [c - u for c, u in zip(conditional, unconditional)]
            differences.append(sum(terms) / len(terms))
        meta = self._meta(scores, unconditional_token_logprobs=scores.unconditional,
                          normalized_unconditional_prompt_logprobs=differences)
        return ChoicesDecision(scores.choices[_argmax(differences)], meta)


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
