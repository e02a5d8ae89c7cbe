"""Log-probabilities of chosen tokens and of the top alternatives, in the native API's shape.

Each entry is ``[logprob, token_id, text_or_None]``; top alternatives are a list of such
entries, most likely first. Logprobs are those of the model's distribution (log-softmax of
the raw logits), before penalties, temperature or filtering.

They are computed on the logits' device (``logprob_tensors``) and reach the host in one
copy, however many rows a step asks about. In the step loop the copy is started with the
sampling (``LogprobCopy.start``) and read only once the step's tokens have been read
(``LogprobCopy.read``): on CUDA it goes into pinned memory behind the step's kernels, so the
read waits for nothing the token read has not waited for already.
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
        """``logprob_tensors`` on the logits' device, then one copy to the host, waited
        for at once (outside the step loop; the loop uses ``LogprobCopy``)."""
        return LogprobCopy.start(logits, token_ids, top_k).read()

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


class LogprobCopy:
    """``logprob_tensors``' results on their way to the host: the float32 logprobs travel
    as their int32 bit patterns beside the token ids, one (N, 2 + 2k) int32 tensor.

    ``start`` queues the copy and returns at once; ``read`` waits for it. On CUDA the copy
    goes into pinned memory of its own (never reused, so a later step cannot overwrite it)
    behind the kernels queued so far, and ``read`` waits on an event recorded after it, not
    on kernels queued later. Elsewhere the tensor is read where it lies."""

    def __init__(self, packed: torch.Tensor, top_k: int, copied: torch.cuda.Event | None):
        self._packed, self._k, self._copied = packed, top_k, copied

    @classmethod
    def start(cls, logits: torch.Tensor, token_ids: torch.Tensor, top_k: int) -> LogprobCopy:
        """Computes the logprobs of ``token_ids`` (N,) under ``logits`` (N, V) and the
        ``top_k`` alternatives on the logits' device and starts their copy to the host."""
        chosen, values, ids = logprob_tensors(logits, token_ids, top_k)
        packed = torch.cat([  # (N, 2 + 2k) int32
            token_ids[:, None].int(), chosen[:, None].view(torch.int32),
            values.view(torch.int32), ids.int(),
        ], dim=1)
        copied = None
        if packed.device.type == "cuda":
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            packed = host
        return cls(packed, values.shape[-1], copied)

    def read(self) -> Logprobs:
        """The host lists, once the copy has landed (call it after the step's tokens are
        read: then it waits for nothing more)."""
        if self._copied is not None:
            self._copied.synchronize()
        packed, k = self._packed, self._k
        return Logprobs(
            token_ids=packed[:, 0].tolist(),
            chosen=packed[:, 1].view(torch.float32).tolist(),
            top_values=packed[:, 2 : 2 + k].contiguous().view(torch.float32).tolist(),
            top_ids=packed[:, 2 + k :].tolist(),
        )


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
