"""Per-row token lists and token counts for the sampling batch, on the device, shaped so that
applying them to (B, V) logits costs a gather and a scatter over the listed tokens only.

``TokenRows``: each row's list (token ids, or values beside them) as one (K, n) tensor. A row
shorter than n is padded, with a constant or by repeating its own first entry, chosen by the
user so that a gather-compute-scatter over a row's entries gives every repeat of an id the
same value: repeats then change nothing. Lists grow at the end of each row (a per-row write
position on the device); capacity doubles, so appends are amortised O(rows).

``CountPool``: (slots, V) int32 counts of tokens. Each row holds a slot that never moves, so
rows joining cost O(V) for themselves and rows leaving cost nothing but their slot's return:
the table is never copied as rows come and go.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from radixlm.host_to_device import to_device


class TokenRows:
    """Rows of ids (or values) of different lengths, padded into one tensor.

    Invariants: ``values`` is (K, width) on ``device``, row ``i`` holding its list, then
    padding; ``width`` is the longest list's length (at least 1), known on the host.
    """

    def __init__(self, lists: Sequence[Sequence[int | float]], dtype: torch.dtype,
                 device: torch.device, pad: int | float | None = None):
        """``pad``: the padding value, or None to repeat each row's first entry (0 for an
        empty row). Host work is O(entries), not O(rows x width): rows are padded on the
        device."""
        self.dtype, self.device, self.pad = dtype, device, pad
        self._host_lens = [len(row) for row in lists]
        self.width = max(self._host_lens, default=1) or 1
        self._lens = to_device(self._host_lens, torch.int64, device)  # (K,)
        if pad is None:
            firsts = to_device([row[0] if row else 0 for row in lists], dtype, device)
            self._buf = firsts[:, None].repeat(1, self.width)  # (K, width)
        else:
            self._buf = torch.full((len(lists), self.width), pad, dtype=dtype, device=device)
        flat = list(itertools.chain.from_iterable(lists))
        if flat:
            rows = torch.arange(len(lists), device=device)
            rows = torch.repeat_interleave(rows, self._lens, output_size=len(flat))  # (T,)
            starts = torch.cumsum(self._lens, 0) - self._lens
            starts = torch.repeat_interleave(starts, self._lens, output_size=len(flat))
            columns = torch.arange(len(flat), device=device) - starts  # (T,)
            self._buf[rows, columns] = to_device(flat, dtype, device)

    @property
    def values(self) -> torch.Tensor:
        return self._buf[:, : self.width]

    def __len__(self) -> int:
        return self._buf.shape[0]

    def extend(self, other: TokenRows) -> None:
        """Appends ``other``'s rows."""
        columns = max(self._buf.shape[1], other._buf.shape[1])
        self._reserve(columns, exact=True)
        other._reserve(columns, exact=True)
        self._buf = torch.cat([self._buf, other._buf])
        self._lens = torch.cat([self._lens, other._lens])
        self._host_lens += other._host_lens
        self.width = max(self.width, other.width)

    def keep(self, rows: list[int], index: torch.Tensor) -> None:
        """Keeps ``rows``, in that order (``index``: the same on the device)."""
        self._buf = self._buf.index_select(0, index)
        self._lens = self._lens.index_select(0, index)
        self._host_lens = [self._host_lens[row] for row in rows]
        self.width = max(self._host_lens, default=1) or 1

    def append(self, columns: torch.Tensor, rows: slice) -> None:
        """Appends ``columns`` (R, m) to the lists of ``rows`` (R of them)."""
        count = columns.shape[1]
        lens = [n + count for n in self._host_lens[rows]]
        self._host_lens[rows] = lens
        self.width = max([self.width, *lens])
        self._reserve(self.width)
        offsets = torch.arange(count, device=self.device)  # (m,)
        positions = self._lens[rows, None] + offsets  # (R, m)
        self._buf[rows].scatter_(1, positions, columns.to(self.dtype))
        self._lens[rows] += count

    def _reserve(self, columns: int, exact: bool = False) -> None:
        """Grows the buffer to ``columns`` columns (when ``exact``) or more (doubling), padding
        the new ones."""
        have = self._buf.shape[1]
        if columns <= have:
            return
        grown = torch.empty(len(self), columns if exact else max(columns, 2 * have),
                            dtype=self.dtype, device=self.device)
        grown[:, :have] = self._buf
        if self.pad is None:
            grown[:, have:] = self._buf[:, :1]
        else:
            grown[:, have:] = self.pad
        self._buf = grown


class CountPool:
    """Token counts (slots, V) int32 on ``device``; a slot belongs to one row until freed."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size, self.device = vocab_size, device
        self.table = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self._free: list[int] = []

    def allocate(self, lists: Sequence[Sequence[int]]) -> list[int]:
        """A slot for each list, holding the counts of its tokens (ids past the vocabulary
        are left out)."""
        while len(self._free) < len(lists):
            have = self.table.shape[0]
            grown = max(2 * have, have + len(lists) - len(self._free), 8)
            self.table = torch.cat([self.table, torch.zeros(
                grown - have, self.vocab_size, dtype=torch.int32, device=self.device)])
            self._free += range(have, grown)
        slots = [self._free.pop() for _ in lists]
        self.table[to_device(slots, torch.int64, self.device)] = 0
        rows, ids = [], []
        for slot, tokens in zip(slots, lists):
            kept = [t for t in tokens if t < self.vocab_size]
            rows += [slot] * len(kept)
            ids += kept
        if ids:
            self.add(to_device(rows, torch.int64, self.device),
                     to_device(ids, torch.int64, self.device))
        return slots

    def free(self, slots: Sequence[int]) -> None:
        self._free += slots

    def add(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Counts one more of each of ``tokens`` in the matching ``slots`` (same shapes)."""
        ones = torch.ones_like(tokens, dtype=torch.int32)
        self.table.index_put_((slots, tokens), ones, accumulate=True)
