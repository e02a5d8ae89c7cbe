"""What is done to the logits before a token is drawn: logit bias, the repetition, frequency
and presence penalties, and the ``min_new_tokens`` ban on stop tokens.

Each has per-row state kept in the ``SamplingBatch``: ``*_rows`` functions build it for rows
joining the batch (from their params and the tokens they have so far), on the batch's
device; ``apply_*`` functions apply it to (B, V) logits in place, with tensor ops only, and
touch only the tokens a row lists (a gather, a computation, a scatter), never the whole
vocabulary. A row that does not use a setting holds its neutral value (bias 0, penalty 1 or
0, no ban), so a setting applies to the whole batch at once and leaves such rows' logits
exactly as they were.

Token lists are ``TokenRows``, padded so that repeats of an id compute the same value: the
repetition penalty's seen tokens and the ban's stop tokens repeat the row's first entry; the
frequency penalty's output tokens and the bias's tokens pad with token 0, whose update is
computed from its own count (0: no change) or bias (0.0).

The repetition penalty covers prompt and output (as transformers and vLLM apply it); the
frequency and presence penalties cover the output only (as the OpenAI API defines them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from radixlm.host_to_device import to_device
from radixlm.runtime.sampling.token_rows import TokenRows

if TYPE_CHECKING:
    from radixlm.runtime.sampling.sampling_params import SamplingParams

_NEG_INF = float("-inf")


def column(values: list[float] | list[int], dtype: torch.dtype,
           device: torch.device) -> torch.Tensor:
    """(K, 1): one value per row, as a column that broadcasts over the vocabulary."""
    return to_device(values, dtype, device)[:, None]


# Building each setting's state for rows joining the batch ----------------------------------


def bias_rows(params: Sequence[SamplingParams], vocab_size: int,
              device: torch.device) -> tuple[TokenRows, TokenRows]:
    """Each row's ``logit_bias``: token ids (K, n) int64 and biases (K, n) float32."""
    biases = [{int(token): value for token, value in (p.logit_bias or {}).items()
               if int(token) < vocab_size} for p in params]
    return (TokenRows([list(b) for b in biases], torch.int64, device, pad=0),
            TokenRows([list(b.values()) for b in biases], torch.float32, device, pad=0.0))


def frequency_rows(params: Sequence[SamplingParams], outputs: Sequence[Sequence[int]],
                   vocab_size: int, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor, TokenRows]:
    """Frequency and presence penalties (K, 1) float32, and each row's output tokens (K, n)
    (their counts are kept in a ``CountPool``)."""
    return (
        column([p.frequency_penalty for p in params], torch.float32, device),
        column([p.presence_penalty for p in params], torch.float32, device),
        TokenRows([[t for t in out if t < vocab_size] for out in outputs], torch.int64,
                  device, pad=0),
    )


def repetition_rows(params: Sequence[SamplingParams], sequences: Sequence[Sequence[int]],
                    vocab_size: int, device: torch.device
                    ) -> tuple[torch.Tensor, TokenRows]:
    """Repetition penalties (K, 1) float32, and each row's distinct prompt and output tokens
    (K, n) int64 (non-empty: a prompt has a token)."""
    return (
        column([p.repetition_penalty for p in params], torch.float32, device),
        TokenRows([sorted({t for t in seq if t < vocab_size}) for seq in sequences],
                  torch.int64, device),
    )


def ban_rows(params: Sequence[SamplingParams], output_lens: Sequence[int],
             eos_token_ids: Sequence[int], device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor, TokenRows]:
    """The output length below which stop tokens are banned (K, 1) int64 (0 for a row with
    nothing to ban), ``output_lens`` (K, 1) int64, and the banned tokens (K, n) int64:
    ``stop_token_ids``, and EOS unless ``ignore_eos``."""
    banned = []
    for p in params:
        ids = list(p.stop_token_ids or []) if p.min_new_tokens > 0 else []
        if p.min_new_tokens > 0 and not p.ignore_eos:
            ids += eos_token_ids
        banned.append(ids)
    return (
        column([p.min_new_tokens if ids else 0 for p, ids in zip(params, banned)],
               torch.int64, device),
        column(list(output_lens), torch.int64, device),
        TokenRows(banned, torch.int64, device),
    )


# Applying them to (B, V) logits, in place ---------------------------------------------------


def apply_bias(logits: torch.Tensor, ids: torch.Tensor, biases: torch.Tensor) -> None:
    """Adds ``biases`` (B, n) to the logits of tokens ``ids`` (B, n)."""
    if biases.dtype != logits.dtype:
        biases = biases.to(logits.dtype)
    logits.scatter_add_(1, ids, biases)


def apply_repetition(logits: torch.Tensor, repetition: torch.Tensor,
                     seen: torch.Tensor) -> None:
    """Seen tokens' (B, n) positive logits are divided by the penalty, negative ones
    multiplied."""
    repetition = repetition.to(logits.dtype)
    values = logits.gather(1, seen)  # (B, n)
    logits.scatter_(1, seen, torch.where(values > 0, values / repetition, values * repetition))


def apply_frequency(logits: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor,
                    output_ids: torch.Tensor, counts: torch.Tensor) -> None:
    """Subtracts ``frequency * count + presence * (count > 0)`` from the logits of the
    output tokens ``output_ids`` (B, n), whose ``counts`` (B, n) are given."""
    values = logits.gather(1, output_ids)  # (B, n)
    logits.scatter_(1, output_ids, values - (frequency * counts + presence * (counts > 0)))


def apply_ban(logits: torch.Tensor, ban_below: torch.Tensor, output_lens: torch.Tensor,
              banned: torch.Tensor, exempt: torch.Tensor | None) -> None:
    """Bans tokens ``banned`` (B, n) in rows whose output (B, 1) is shorter than
    ``ban_below`` (B, 1), but not in ``exempt`` rows (K,) (a complete grammar: else nothing
    might be allowed)."""
    active = output_lens < ban_below  # (B, 1)
    if exempt is not None:
        active[exempt] = False
    values = logits.gather(1, banned)
    logits.scatter_(1, banned, values.masked_fill(active, _NEG_INF))
