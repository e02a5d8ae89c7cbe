"""Log-probabilities of chosen tokens and of the top alternatives, in the native API's shape.

Each entry is ``[logprob, token_id, text_or_None]``; top alternatives are a list of such
entries, most likely first. Logprobs are those of the model's distribution (log-softmax of
the raw logits), before penalties, temperature or filtering.

They are computed on the logits' device (``logprob_tensors``) and reach the host in one
copy (``Logprobs.compute``), however many rows a step asks about.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from radixlm.host_to_device import to_device

Entry = list[Any]
Decode = Callable[[int], str]


def logprob_tensors(logits: torch.Tensor, token_ids: torch.Tensor, top_k: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits (N, V) predicting ``token_ids`` (N,) int64, all on one device -> the chosen
    tokens' logprobs (N,) float32, and the ``top_k`` largest logprobs (N, k) float32 with
    their token ids (N, k) int64, most likely first, on that device."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (N, V)
    chosen = logprobs.gather(1, token_ids[:, None])[:, 0]
    values, ids = logprobs.topk(min(top_k, logprobs.shape[-1]), dim=-1)
    return chosen, values, ids


@dataclass
class Logprobs:
    """Host copies of ``logprob_tensors``' results, by row."""

    token_ids: list[int]
    chosen: list[float]
    top_values: list[list[float]]
    top_ids: list[list[int]]

    @classmethod
    def compute(cls, logits: torch.Tensor, token_ids: torch.Tensor, top_k: int) -> Logprobs:
        """``logprob_tensors`` on the logits' device, then one copy to the host: the
        float32 logprobs travel as their int32 bit patterns beside the token ids."""
        chosen, values, ids = logprob_tensors(logits, token_ids, top_k)
        k = values.shape[-1]
        packed = torch.cat([  # (N, 2 + 2k) int32
            token_ids[:, None].int(), chosen[:, None].view(torch.int32),
            values.view(torch.int32), ids.int(),
        ], dim=1).cpu()
        return cls(
            token_ids=packed[:, 0].tolist(),
            chosen=packed[:, 1].view(torch.float32).tolist(),
            top_values=packed[:, 2 : 2 + k].contiguous().view(torch.float32).tolist(),
            top_ids=packed[:, 2 + k :].tolist(),
        )

    def extend(self, more: Logprobs) -> None:
        """Appends ``more``'s rows (computed with the same ``top_k``) after these."""
        self.token_ids += more.token_ids
        self.chosen += more.chosen
        self.top_values += more.top_values
        self.top_ids += more.top_ids

    def entries(self, start: int, stop: int, decode: Decode | None) -> list[Entry]:
        """The chosen tokens' entries of rows ``start .. stop - 1``."""
        return [_entry(lp, tid, decode) for lp, tid in
                zip(self.chosen[start:stop], self.token_ids[start:stop])]

    def tops(self, start: int, stop: int, top_k: int, decode: Decode | None
             ) -> list[list[Entry]]:
        """The ``top_k`` alternatives' entries of each of rows ``start .. stop - 1``."""
        return [[_entry(lp, tid, decode) for lp, tid in zip(values[:top_k], ids[:top_k])]
                for values, ids in zip(self.top_values[start:stop], self.top_ids[start:stop])]


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int] | torch.Tensor, top_k: int,
    decode: Decode | None,
) -> tuple[list[Entry], list[list[Entry]]]:
    """logits: (N, V) predicting ``token_ids`` (N,) -> (chosen entries, top-k entries per row;
    none when ``top_k`` is 0).

    ``decode`` maps a token id to its text when texts are wanted (else texts are None).
    """
    if not isinstance(token_ids, torch.Tensor):
        token_ids = to_device(list(token_ids), torch.int64, logits.device)
    found = Logprobs.compute(logits, token_ids, top_k)
    rows = len(found.chosen)
    return found.entries(0, rows, decode), found.tops(0, rows, top_k, decode) if top_k else []


def _entry(logprob: float, token_id: int, decode: Decode | None) -> Entry:
    return [logprob, token_id, decode(token_id) if decode else None]
