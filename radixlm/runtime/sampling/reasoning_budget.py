"""A thinking budget (``max_reasoning_tokens``): once a request has written that many tokens
and its output does not yet contain the end of its reasoning (``reasoning_end_token_ids``,
``</think>``'s ids), those ids are forced, one a step, every other token masked; after them
it samples freely. Once the end sequence has appeared, sampled or forced, nothing more is
forced (a sequence completed part way through the forcing stops it there).

Where it lives: a feature of the ``SamplingBatch`` (``BUDGET``), so its state joins and
leaves with the rows, and a step over a batch where no row has a budget costs one counter
test (``forcing_rows`` returns at once, the sampler clones nothing).

What is known where:

- The host knows each row's output length (``SamplingBatch.position``, counted by the batch
  as it records tokens, so it runs ahead of the host appending them under overlap
  scheduling), hence which rows are in their forcing window (positions ``limit`` ..
  ``limit + len(end ids) - 1``) and which end id is due. Outside that window a row costs
  nothing at sampling.
- Whether the end sequence has appeared depends on the tokens drawn, which stay on the
  device: each row keeps its last tokens (``budget_window``, most recent first, as wide as
  its end sequence) and a sticky ``budget_matched`` flag, updated on the device as tokens
  are recorded (``record``). A forcing row is forced only where that flag is still false,
  decided on the device: the host never waits for a token.

Combined with other settings: the force is applied after logit bias, penalties, the
``min_new_tokens`` ban and the grammar mask, and only where those left the forced token
possible (its logit above -inf). A row whose grammar (or ban) forbids the due end id is
sampled as if it had no budget at that step: the grammar wins. The chat APIs do not give a
budget together with a tool-call grammar that would forbid ``</think>``.

Columns (K rows, M = the longest end sequence among the rows): ``budget_ends`` (K, M)
int64, each row's end ids reversed, padded with -1 (a row without a budget: all -1);
``budget_window`` (K, M) int64, the row's last tokens, most recent first, -1 where the
output is shorter; ``budget_matched`` (K, 1) bool (True for rows without a budget). A row
compares the first len(its end ids) columns only: a -1 in ``budget_ends`` matches anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from radixlm.host_to_device import to_device
from radixlm.runtime.sampling.token_rows import TokenRows

if TYPE_CHECKING:
    from radixlm.runtime.sampling.sampling_params import SamplingParams

BUDGET = "reasoning_budget"
COLUMNS = ("budget_ends", "budget_window", "budget_matched")
_PAD = -1  # no token id: in the ends, matches any token; in a window, no token (yet)


class BudgetRequest(Protocol):
    """What the budget reads of a request."""

    sampling: SamplingParams
    output_ids: list[int]


class BudgetRows(Protocol):
    """What forcing reads of the ``SamplingBatch`` (or a view of it)."""

    reqs: Sequence[BudgetRequest]
    budget_matched: torch.Tensor | None

    def uses(self, feature: str) -> bool: ...

    def position(self, row: int) -> int: ...


def has_budget(req: BudgetRequest) -> bool:
    params = req.sampling
    return params.max_reasoning_tokens is not None and bool(params.reasoning_end_token_ids)


def budget_rows(reqs: Sequence[BudgetRequest], device: torch.device
                ) -> tuple[TokenRows, TokenRows, torch.Tensor]:
    """The columns (``COLUMNS``' order) of rows joining the batch, from their outputs so far:
    whether the end sequence is anywhere in an output (a request re-admitted after a
    retraction may have written it long ago) is found here, on the host, once."""
    ends, windows, matched = [], [], []
    for req in reqs:
        if not has_budget(req):
            ends.append([])
            windows.append([])
            matched.append(True)
            continue
        end_ids = req.sampling.reasoning_end_token_ids
        size = len(end_ids)
        tail = req.output_ids[-size:]
        ends.append(end_ids[::-1])
        windows.append(tail[::-1] + [_PAD] * (size - len(tail)))
        matched.append(_contains(req.output_ids, end_ids))
    return (TokenRows(ends, torch.int64, device, pad=_PAD),
            TokenRows(windows, torch.int64, device, pad=_PAD),
            to_device(matched, torch.bool, device)[:, None])


def record(ends: torch.Tensor, window: torch.Tensor, matched: torch.Tensor,
           tokens: torch.Tensor, rows: slice) -> None:
    """Appends ``tokens`` (R, m), in order, to the windows of ``rows`` (R of them), and
    marks the rows whose end sequence they complete; on the device, in place."""
    window, ends = window[rows], ends[rows]  # (R, M) views
    anything = ends == _PAD
    found = torch.zeros_like(matched[rows])  # (R, 1)
    for column in range(tokens.shape[1]):  # one column a step; more after jump-forward
        window[:, 1:] = window[:, :-1].clone()
        window[:, 0] = tokens[:, column]
        found |= ((window == ends) | anything).all(dim=-1, keepdim=True)
    matched[rows] |= found


def forcing_rows(batch: BudgetRows) -> list[tuple[int, int]]:
    """(row, the end id due) of each row in its forcing window, whether or not its end
    sequence has appeared (that is the device's to say: ``force``). Empty at once when no
    row has a budget."""
    if not batch.uses(BUDGET):
        return []
    found = []
    for row, req in enumerate(batch.reqs):
        if not has_budget(req):
            continue
        step = batch.position(row) - req.sampling.max_reasoning_tokens
        end_ids = req.sampling.reasoning_end_token_ids
        if 0 <= step < len(end_ids):
            found.append((row, end_ids[step]))
    return found


def force(logits: torch.Tensor, batch: BudgetRows, forcing: list[tuple[int, int]]) -> None:
    """Masks every token but the due end id in the (B, V) ``logits`` of ``forcing``'s rows
    whose end sequence has not appeared and whose logits still allow that id; in place."""
    device = logits.device
    rows = to_device([row for row, _ in forcing], torch.int64, device)  # (F,)
    due = to_device([token for _, token in forcing], torch.int64, device)[:, None]  # (F, 1)
    picked = logits.index_select(0, rows)  # (F, V)
    allowed = picked.gather(1, due) > float("-inf")  # (F, 1)
    pending = allowed & ~batch.budget_matched.index_select(0, rows)
    only_due = torch.full_like(picked, float("-inf")).scatter_(1, due, 0.0)
    logits.index_copy_(0, rows, torch.where(pending, only_due, picked))


def _contains(output: list[int], end_ids: list[int]) -> bool:
    size = len(end_ids)
    first = end_ids[0]
    return any(output[i] == first and output[i:i + size] == end_ids
               for i in range(len(output) - size + 1))
