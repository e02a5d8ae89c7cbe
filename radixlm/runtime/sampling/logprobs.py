"""Log-probabilities of chosen tokens and of the top alternatives, in the native API's shape.

Each entry is ``[logprob, token_id, text_or_None]``; top alternatives are a list of such
entries, most likely first. Logprobs are those of the model's distribution (log-softmax of
the raw logits), before penalties, temperature or filtering.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Entry = list[Any]


def token_logprobs(
    logits: torch.Tensor, token_ids: list[int], top_k: int,
    decode: Callable[[int], str] | None,
) -> tuple[list[Entry], list[list[Entry] | None]]:
    """logits: (N, V) predicting ``token_ids`` (N,) -> (chosen entries, top-k entries per row).

    ``decode`` maps a token id to its text when texts are wanted (else texts are None).
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(token_ids, dtype=torch.int64)[:, None])[:, 0]
    entries = [_entry(lp, tid, decode) for lp, tid in zip(chosen.tolist(), token_ids)]
    tops: list[list[Entry] | None] = []
    if top_k > 0:
        values, ids = logprobs.topk(min(top_k, logprobs.shape[-1]), dim=-1)
        for row_values, row_ids in zip(values.tolist(), ids.tolist()):
            tops.append([_entry(lp, tid, decode) for lp, tid in zip(row_values, row_ids)])
    return entries, tops


def _entry(logprob: float, token_id: int, decode: Callable[[int], str] | None) -> Entry:
    return [logprob, token_id, decode(token_id) if decode else None]
