"""From logits to next tokens: logit bias, penalties, temperature, top-k / top-p / min-p, sampling.

All rows of a batch are processed together as (B, V) tensors, with each row's settings read
from the ``SamplingBatch`` as (B, 1) columns. Greedy rows take the argmax of the processed
logits. Sampled rows draw by inverse transform: the first token whose running sum of
probabilities exceeds U times the row's kept mass, one uniform U a row. That samples from p
exactly (to float64 sums) and lets a seeded request draw its U from its own generator,
reseeded for (its seed, its output position), so its tokens depend only on those, never on
what else is in the batch. One draw a row, not one a token: on CPUs, drawing a uniform for
every token of a batch's rows took longer than the float64 running sums and the search
together (benchmarks/RESULTS.md).

A constrained request's grammar mask is applied after bias and penalties, so that
whatever else is set, only tokens the grammar allows can be drawn; a thinking budget's forced
token comes last, where the grammar allows it (``reasoning_budget``). The ``min_new_tokens``
ban on stop tokens yields to a grammar that is complete (else nothing might be allowed).

Device-true: every tensor is made on the logits' device, and nothing waits on that device:
what to run is decided from the batch's host state (on CPUs also from values, which costs
nothing there), and the draws use generators on the logits' device (one per device, seeded
with the server's ``random_seed``; the ``meta`` device, which has values for nothing, draws
without one).
"""

from __future__ import annotations

import torch

from radixlm.host_to_device import to_device
from radixlm.kernels.cpu_ops import fused_ops
from radixlm.runtime.grammar.grammar_backend import GrammarBackend
from radixlm.runtime.sampling import penalties, reasoning_budget
from radixlm.runtime.sampling.sampling_batch import (
    GRAMMAR,
    MIN_P,
    SAMPLED,
    TOP_K_P,
    SamplingBatch,
)

TOP_CANDIDATES = 256  # tokens ranked first for top-k / top-p on CPUs (``_top_k_top_p``)


class Sampler:
    """Draws the next token of each row of a ``SamplingBatch`` from its logits.

    ``sample`` reads the batch and leaves it as it was: recording the drawn tokens into it
    (``SamplingBatch.record_sampled``) is the caller's, as are rows joining and leaving.
    """

    def __init__(self, vocab_size: int, eos_token_ids: set[int], seed: int,
                 grammar_backend: GrammarBackend | None = None):
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.seed = seed
        self.grammar_backend = grammar_backend
        self._generators: dict[torch.device, torch.Generator] = {}
        self._seeded: dict[torch.device, torch.Generator] = {}  # reseeded per seeded draw

    def new_batch(self, device: torch.device | str) -> SamplingBatch:
        """An empty batch for logits on ``device``."""
        return SamplingBatch(self.vocab_size, self.eos_token_ids, device)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits: (B, V') for the next token of each of ``batch``'s rows (V' >= vocab_size)
        -> (B,) int64 token ids on the logits' device.

        The caller's ``logits`` are never modified."""
        if logits.shape[0] != len(batch) or not batch.holds(logits):
            raise ValueError(f"logits {tuple(logits.shape)} on {logits.device} do not match a "
                             f"sampling batch of {len(batch)} rows on {batch.device}")
        logits = logits[:, : self.vocab_size]
        if batch.is_plain_greedy():
            return _argmax(logits)
        banning = batch.banning_rows()
        processing = bool(banning) or batch.needs_penalties()
        constrained = batch.uses(GRAMMAR)
        forcing = reasoning_budget.forcing_rows(batch)
        if processing or constrained or forcing:
            logits = logits.clone()
        if processing:
            self.process_logits(logits, batch, banning)
        if constrained:
            self.grammar_backend.mask_logits(logits, batch.matchers())
        if forcing:  # last: only where the rest still allows the forced token
            reasoning_budget.force(logits, batch, forcing)
        if not batch.uses(SAMPLED):
            return _argmax(logits)
        greedy = _argmax(logits)
        probs = torch.softmax(logits / batch.temperatures.to(logits.dtype), dim=-1)  # (B, V)
        probs = _filter_probs(probs, batch)
        return torch.where(batch.greedy, greedy, self._draw(probs, batch))

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """(N, V') -> (N,): each row's most likely token, as ``sample`` chooses it for a
        plain greedy batch (any number of rows: a verify step's positions)."""
        return _argmax(logits[:, : self.vocab_size])

    def _draw(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """One token per row of (B, V) ``probs`` (what the filters kept, not renormalised):
        the first token whose running sum of probs exceeds U times the row's kept mass, U
        uniform in [0, 1), one draw a row (inverse transform sampling). A token with no
        mass adds nothing to the sum, so it is never drawn. The sums are float64, so a
        token's share is its probability to about 1e-16."""
        cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # (B, V)
        total = cdf[:, -1:]  # (B, 1), > 0: every row keeps its most likely token
        uniform = torch.empty_like(total).uniform_(generator=self._generator(probs.device))
        seeded = self._seeded_generator(probs.device)
        for row, seed, position in batch.seeded_rows():
            if seeded is not None:
                seeded.manual_seed(_seed_for_step(seed, position))
            uniform[row].uniform_(generator=seeded)
        # U * total may round up to total; below it some running sum still exceeds it.
        target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
        drawn = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # (B,)
        return drawn.clamp_(max=probs.shape[-1] - 1)  # a row of NaNs finds no token: stay in range

    def process_logits(self, logits: torch.Tensor, batch: SamplingBatch,
                       banning: list[int] | None = None) -> torch.Tensor:
        """Applies logit bias, penalties and the min_new_tokens ban to (B, V) ``logits`` in
        place (and returns them). ``banning``: ``batch.banning_rows()``, if known."""
        if batch.bias_ids is not None:
            penalties.apply_bias(logits, batch.bias_ids, batch.bias_values)
        if batch.seen_ids is not None:
            penalties.apply_repetition(logits, batch.repetition_penalties, batch.seen_ids)
        if batch.output_ids is not None:
            counts = batch.count_table[batch.count_slots[:, None], batch.output_ids]  # (B, n)
            penalties.apply_frequency(logits, batch.frequency_penalties,
                                      batch.presence_penalties, batch.output_ids, counts)
        if banning is None:
            banning = batch.banning_rows()
        if banning:
            exempt = [row for row in banning
                      if (matcher := batch.reqs[row].grammar) is not None
                      and matcher.is_completed()]
            penalties.apply_ban(
                logits, batch.ban_below, batch.output_lens, batch.banned_ids,
                to_device(exempt, torch.int64, logits.device) if exempt else None,
            )
        return logits

    def _generator(self, device: torch.device) -> torch.Generator | None:
        if device.type == "meta":
            return None
        if device not in self._generators:
            self._generators[device] = torch.Generator(device).manual_seed(self.seed)
        return self._generators[device]

    def _seeded_generator(self, device: torch.device) -> torch.Generator | None:
        if device.type == "meta":
            return None
        if device not in self._seeded:
            self._seeded[device] = torch.Generator(device)
        return self._seeded[device]


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """(B, V) -> (B,): each row's ``argmax``, on CPUs through the fused kernels' vectorised
    one where they are on (the same answers; torch's is scalar and several times slower,
    at one row and at 16: benchmarks/RESULTS.md)."""
    kernels = fused_ops.for_tensor(logits)
    if kernels is not None and logits.dtype == torch.float32 and logits.stride(-1) == 1:
        return kernels.argmax_rows(logits)
    return logits.argmax(dim=-1)


def _filter_probs(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Zeroes what top-k, top-p and min-p exclude (the sampling draws from the rest)."""
    if batch.uses(TOP_K_P):
        probs = _top_k_top_p(probs, batch)
    if batch.uses(MIN_P):
        threshold = probs.max(dim=-1, keepdim=True).values * batch.min_ps.to(probs.dtype)
        probs = probs * (probs >= threshold)
    return probs


def _top_k_top_p(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """(B, V) probs with what top-k and top-p exclude zeroed: a token stays while its rank
    is below top_k and the mass ranked before it is below top_p (the first always stays).

    On CPUs the ranking starts from the ``TOP_CANDIDATES`` most likely tokens of each row
    (``topk`` is far cheaper than a full sort of a row of the vocabulary); it is exact when every
    row's kept tokens lie among them (its top_k is at most that many, or they hold top_p of
    the mass, or it restricts nothing), else every row is sorted whole. That test reads a
    value: free on a CPU, a wait on an accelerator, where the full sort always runs."""
    vocab = probs.shape[-1]
    if probs.device.type == "cpu" and vocab > TOP_CANDIDATES:
        ranked, order = probs.topk(TOP_CANDIDATES, dim=-1)  # (B, K) descending
        mass = ranked.cumsum(dim=-1)
        unrestricted = (batch.top_ks >= vocab) & (batch.top_ps > 1)  # (B, 1)
        inside = ((batch.top_ks <= TOP_CANDIDATES) | unrestricted
                  | (mass[:, -1:] >= batch.top_ps.to(probs.dtype)))
        if bool(inside.all()):
            kept = _keep_ranked(probs, ranked, order, batch, mass)
            return torch.where(unrestricted, probs, kept)
    ranked, order = probs.sort(dim=-1, descending=True)
    return _keep_ranked(probs, ranked, order, batch)


def _keep_ranked(probs: torch.Tensor, ranked: torch.Tensor, order: torch.Tensor,
                 batch: SamplingBatch, mass: torch.Tensor | None = None) -> torch.Tensor:
    """``ranked`` (B, K): each row's K most likely probs, descending, at columns ``order``;
    ``mass``: their running sum, if known. -> (B, V): the kept ones in place, zeros
    elsewhere."""
    ranks = torch.arange(ranked.shape[-1], device=probs.device)[None, :]  # (1, K)
    mass_before = (ranked.cumsum(dim=-1) if mass is None else mass) - ranked
    keep = (ranks < batch.top_ks) & (mass_before < batch.top_ps.to(probs.dtype))
    ranked = ranked * keep  # (a product: on CPUs far cheaper than masked_fill)
    return torch.zeros_like(probs).scatter_(-1, order, ranked)


def _seed_for_step(seed: int, step: int) -> int:
    """A distinct, reproducible generator seed for each (request seed, output position)."""
    return (seed * 1_000_003 + step * 7_919 + 1) % (2**63 - 1)
