"""Beam search's choices, step by step, with transformers' semantics (``generate(num_beams=k,
do_sample=False)``); no KV, no requests: ``scheduler/beam_groups.py`` applies the choices.

Each step takes the k running beams' next-token log-probabilities (k, V), adds each beam's
running score (the sum of its tokens' logprobs), and keeps the best ``(1 + eos) * k``
candidates (at least 2k) over all k x V. A candidate that ends (an EOS token, or the output
budget reached) is a finished hypothesis if it ranks among the first k candidates; the
others continue. The next running beams are the best k candidates that do not end.
Finished hypotheses are scored ``sum_logprobs / generated_len ** length_penalty`` (the
length counts the EOS token) and the best k of them are kept.

The search ends when every candidate ends (the budget), when ``early_stopping`` is True and
k hypotheses are finished, or when the best running beam can no longer beat the worst of
k finished ones. That last test is transformers' heuristic: the running beam's score is
normalised by its current length, or (``early_stopping="never"`` with a positive length
penalty) by the longest length the budget allows. Once it fails, nothing more is added.

The arithmetic is transformers' own in float32 (the same adds of -1e9, the same top-k), so
that equal logits give equal tokens and scores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

EARLY_STOPPING_VALUES = (True, False, "never")
DEAD = -1.0e9
"""transformers' score of a slot that holds nothing, or of a candidate that must not win."""


def length_normaliser(length: int, length_penalty: float) -> float:
    """``length ** length_penalty``, inf where that overflows a float (Python raises)."""
    try:
        return float(length) ** length_penalty
    except OverflowError:
        return math.inf


@dataclass
class Hypothesis:
    """A finished output: its tokens, their summed logprobs and its normalised score.
    ``payload`` is the caller's (what the parent beam held when it finished)."""

    tokens: list[int]
    cumulative_logprob: float
    score: float
    payload: Any = None


@dataclass
class BeamChoice:
    """One step's decision: running beam j continues beam ``parents[j]`` with ``tokens[j]``;
    ``finished`` lists the hypotheses added to the kept ones this step (some may already be
    pushed out again)."""

    parents: list[int]
    tokens: list[int]
    finished: list[Hypothesis] = field(default_factory=list)
    done: bool = False


class BeamSearch:
    """The state of one beam search of width ``width``: the running beams' tokens and
    scores, and the best ``width`` finished hypotheses (best first).

    Invariant: after the first step exactly ``width`` beams run, all with the same number
    of tokens (``length``); before it, one (the prompt).
    """

    def __init__(self, width: int, max_new_tokens: int, eos_token_ids: frozenset[int],
                 length_penalty: float = 1.0, early_stopping: bool | str = False,
                 min_new_tokens: int = 0):
        if early_stopping not in EARLY_STOPPING_VALUES:
            raise ValueError(f"early_stopping must be true, false or 'never', got "
                             f"{early_stopping!r}")
        self.width = width
        self.max_new_tokens = max_new_tokens
        self.eos = sorted(eos_token_ids)  # (for indexing; ``eos_set`` for membership)
        self.eos_set = frozenset(eos_token_ids)
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.min_new_tokens = min_new_tokens
        self.candidates = max(2, 1 + len(self.eos)) * width
        self.reset()

    def reset(self) -> None:
        """Back to before the first step (a retracted search starts over)."""
        self.beams: list[list[int]] = [[]]
        self.running_scores = torch.zeros(1)
        self.kept: list[Hypothesis] = []
        self.improvable = True
        self.done = False

    @property
    def length(self) -> int:
        """Tokens each running beam has."""
        return len(self.beams[0])

    def step(self, logprobs: torch.Tensor, payload_of=lambda parent: None) -> BeamChoice:
        """Advances by one token. ``logprobs`` (len(beams), V) float32: each running beam's
        next-token log-softmax, on any device (the 2k best candidates come to the host, the
        step's one sync). ``payload_of(parent)`` gives what a hypothesis finished from beam
        ``parent`` keeps (called only for those kept)."""
        k = self.width
        length = self.length
        if length < self.min_new_tokens and self.eos:
            logprobs = logprobs.clone()
            logprobs[:, self.eos] = -float("inf")
        vocab = logprobs.shape[1]
        running = self.running_scores.to(logprobs.device, non_blocking=True)
        total = (logprobs + running[:, None]).reshape(-1)
        top_scores, top_index = torch.topk(total, min(self.candidates, total.numel()))
        top_scores, top_index = top_scores.cpu(), top_index.cpu()
        parents = (top_index // vocab).tolist()
        tokens = (top_index % vocab).tolist()
        at_budget = length + 1 >= self.max_new_tokens
        ends = [at_budget or token in self.eos_set for token in tokens]
        ends_mask = torch.tensor(ends, dtype=torch.float32)
        # The next running beams: the best k candidates that do not end.
        running_index = torch.topk(top_scores + ends_mask * DEAD, k)[1].tolist()
        choice = BeamChoice([parents[i] for i in running_index],
                            [tokens[i] for i in running_index])
        self._keep_finished(choice, top_scores, parents, tokens, ends, payload_of)
        self.running_scores = (top_scores + ends_mask * DEAD)[running_index]
        self.beams = [self.beams[p] + [t] for p, t in zip(choice.parents, choice.tokens)]
        self._update_improvable()
        full = len(self.kept) == k
        self.done = choice.done = (not self.improvable or (full and self.early_stopping is True)
                                   or all(ends))
        return choice

    def results(self) -> list[Hypothesis]:
        """The finished hypotheses, best first (``width`` of them once ``done``)."""
        return list(self.kept)

    def _keep_finished(self, choice: BeamChoice, top_scores: torch.Tensor, parents: list[int],
                       tokens: list[int], ends: list[bool], payload_of) -> None:
        """Adds the candidates among the first k that end, where they beat the kept ones."""
        k = self.width
        if not self.improvable or (len(self.kept) == k and self.early_stopping is True):
            return  # transformers adds -1e9 to them: nothing is added
        generated = self.length + 1
        normalised = torch.nan_to_num(top_scores / length_normaliser(generated,
                                                                      self.length_penalty),
                                      nan=-torch.inf)
        new = []
        for i in range(min(k, len(tokens))):
            if ends[i]:
                hypothesis = Hypothesis(self.beams[parents[i]] + [tokens[i]],
                                        float(top_scores[i]), float(normalised[i]))
                new.append((hypothesis, parents[i]))
        if not new:
            return
        # transformers' merge: top-k over the kept scores followed by the new ones (its
        # fillers for empty slots, scored DEAD, never win where scores are above DEAD; a
        # score may be below it or -inf here, at extreme length penalties, so none are added).
        merged = self.kept + [h for h, _ in new]
        scores = torch.tensor([h.score for h in merged], dtype=torch.float32)
        kept = [merged[i] for i in torch.topk(scores, min(k, len(merged)))[1].tolist()]
        for hypothesis, parent in new:
            if any(h is hypothesis for h in kept):
                hypothesis.payload = payload_of(parent)
                choice.finished.append(hypothesis)
        self.kept = kept

    def _update_improvable(self) -> None:
        """transformers' early-stop heuristic (sticky once false)."""
        if not self.improvable or len(self.kept) < self.width:
            return
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_new_tokens
        else:
            best_length = self.length
        best_running = self.running_scores[:1] / length_normaliser(best_length,
                                                                   self.length_penalty)
        worst_kept = min(h.score for h in self.kept)
        self.improvable = bool(best_running[0] > worst_kept)
