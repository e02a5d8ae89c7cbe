"""From logits to next tokens: logit bias, penalties, temperature, top-k / top-p / min-p, sampling.

All requests of a batch are processed together as (B, V) tensors; per-request settings
become (B, 1) columns. Greedy rows take the argmax of the processed logits. Sampled rows
draw with the exponential race (argmax of p / E, E ~ Exp(1)), which samples from p exactly
and lets a seeded request draw its noise from its own generator, so its tokens depend only
on its seed and position, never on what else is in the batch.

A constrained request's grammar mask is applied last, after bias and penalties, so that
whatever else is set, only tokens the grammar allows can be drawn. The ``min_new_tokens``
ban on stop tokens yields to a grammar that is complete (else nothing might be allowed).
"""

from __future__ import annotations

import torch

from radixlm.runtime.grammar.grammar_backend import GrammarBackend
from radixlm.runtime.request import Req

_NEG_INF = float("-inf")


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: set[int], seed: int,
                 grammar_backend: GrammarBackend | None = None):
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.generator = torch.Generator().manual_seed(seed)
        self.grammar_backend = grammar_backend

    def sample(self, logits: torch.Tensor, reqs: list[Req]) -> list[int]:
        """logits: (B, V) float32 for the next token of each request -> one token id each.

        The caller's ``logits`` are never modified."""
        logits = logits[:, : self.vocab_size]
        processing = any(_needs_processing(r) for r in reqs)
        constrained = any(r.grammar is not None for r in reqs)
        if processing or constrained:
            logits = logits.clone()
        if processing:
            logits = self.process_logits(logits, reqs)
        if constrained:
            self.grammar_backend.mask_logits(logits, [r.grammar for r in reqs])
        params = [r.sampling for r in reqs]
        if all(p.is_greedy for p in params):
            return logits.argmax(dim=-1).tolist()
        greedy = logits.argmax(dim=-1)
        temperature = torch.tensor(
            [max(p.temperature, 1e-6) for p in params], dtype=logits.dtype
        )[:, None]
        probs = torch.softmax(logits / temperature, dim=-1)  # (B, V)
        probs = _filter_probs(probs, params)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, req in enumerate(reqs):
            seed = req.sampling.sampling_seed
            if seed is not None:  # redrawn from the request's own generator
                gen = torch.Generator().manual_seed(_seed_for_step(seed, len(req.output_ids)))
                noise[row].exponential_(generator=gen)
        sampled = (probs / noise).argmax(dim=-1)
        is_greedy = torch.tensor([p.is_greedy for p in params])
        return torch.where(is_greedy, greedy, sampled).tolist()

    def process_logits(self, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        """Applies logit bias, penalties and the min_new_tokens ban in place."""
        for row, req in enumerate(reqs):
            params = req.sampling
            if params.logit_bias:
                ids = torch.tensor([int(t) for t in params.logit_bias])
                logits[row, ids] += torch.tensor(list(params.logit_bias.values()))
            if params.needs_penalties:
                _apply_penalties(logits[row], req)
            if len(req.output_ids) < params.min_new_tokens and not (
                req.grammar is not None and req.grammar.is_completed()
            ):
                banned = list(params.stop_token_ids or [])
                if not params.ignore_eos:
                    banned += self.eos_token_ids
                if banned:
                    logits[row, banned] = _NEG_INF
        return logits


def _needs_processing(req: Req) -> bool:
    params = req.sampling
    return bool(params.logit_bias) or params.needs_penalties or (
        len(req.output_ids) < params.min_new_tokens
    )


def _apply_penalties(logits: torch.Tensor, req: Req) -> None:
    """Repetition penalty over prompt and output (as transformers and vLLM apply it);
    frequency and presence penalties over the output only (as the OpenAI API defines them)."""
    params = req.sampling
    vocab = logits.shape[0]
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.input_ids) | set(req.output_ids)), dtype=torch.int64)
        seen = seen[seen < vocab]
        values = logits[seen]
        penalty = params.repetition_penalty
        logits[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if req.output_ids and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(req.output_ids), minlength=vocab)[:vocab]
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)


def _filter_probs(probs: torch.Tensor, params) -> torch.Tensor:
    """Zeroes what top-k, top-p and min-p exclude (the sampling draws from the rest)."""
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(probs.shape[-1])[None, :]
        k = torch.tensor([k if k > 0 else probs.shape[-1] for k in top_k])[:, None]
        # Keep a token while the mass before it is below top_p (the first token always stays).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep = (ranks < k) & (mass_before < torch.tensor(top_p, dtype=probs.dtype)[:, None])
        sorted_probs = sorted_probs * keep  # (a product: on CPUs far cheaper than masked_fill)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    if any(p > 0.0 for p in min_p):
        threshold = probs.max(dim=-1, keepdim=True).values
        threshold = threshold * torch.tensor(min_p, dtype=probs.dtype)[:, None]
        probs = probs * (probs >= threshold)
    return probs


def _seed_for_step(seed: int, step: int) -> int:
    """A distinct, reproducible generator seed for each (request seed, output position)."""
    return (seed * 1_000_003 + step * 7_919 + 1) % (2**63 - 1)
