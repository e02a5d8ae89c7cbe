"""Tensor parallelism (Shoeybi et al. 2019, Megatron-LM): which part of each layer this rank
holds, and the one collective the layers need.

A model built inside ``building(tp)`` splits itself across ``tp.size`` ranks: attention by
heads and the MLP by its intermediate dimension, each rank holding a slice of the column-
parallel projections (q/k/v, gate/up) and the matching columns of the row-parallel ones
(o, down), whose partial outputs are summed over the ranks (``all_reduce``); the embedding
and the LM head split the vocabulary (``vocab_parallel``). Norms and routers are whole on
every rank. Every rank ends each layer with the same hidden states.

Outside ``building`` the model is whole (``SINGLE``) and nothing is communicated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place among ``size`` ranks; ``group``: the torch.distributed process
    group its all-reduces run on (None when ``size`` is 1)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def part(self, total: int, what: str) -> tuple[int, int]:
        """(start, count) of this rank's share of ``total`` equal parts (``what`` names
        them in the error when the size does not divide them)."""
        if total % self.size:
            raise ValueError(f"--tp-size {self.size} does not divide the model's {total} "
                             f"{what}; choose a tensor-parallel size that divides it")
        count = total // self.size
        return self.rank * count, count

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums ``x`` over the ranks, in place (identity when there is one rank)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x


SINGLE = TensorParallel()
_current = SINGLE


def current() -> TensorParallel:
    """The split the layers being built take (``SINGLE`` outside ``building``)."""
    return _current


@contextlib.contextmanager
def building(tp: TensorParallel) -> Iterator[None]:
    """Layers built inside take ``tp``'s share of the model."""
    global _current
    previous, _current = _current, tp
    try:
        yield
    finally:
        _current = previous


@dataclass(frozen=True)
class HeadShare:
    """This rank's attention heads: query heads [q_start, q_start + q_count) and KV heads
    [kv_start, kv_start + kv_count) of the checkpoint's."""

    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


def head_share(tp: TensorParallel, num_heads: int, num_kv_heads: int) -> HeadShare:
    """Query heads are split evenly; KV heads too when there are at least as many as ranks,
    else each is replicated on ``size / num_kv_heads`` ranks (the query heads of a rank
    always read the KV heads of their group). Head counts that cannot be split so are a
    ``ValueError`` naming them: padding heads (as SGLang does on CPUs) would spend compute
    on heads that do nothing, so the size must divide them."""
    q_start, q_count = tp.part(num_heads, f"attention heads ({num_heads} query, "
                                          f"{num_kv_heads} KV)")
    if num_kv_heads >= tp.size:
        kv_start, kv_count = tp.part(num_kv_heads, f"KV heads ({num_heads} query, "
                                                   f"{num_kv_heads} KV)")
    elif tp.size % num_kv_heads:
        raise ValueError(f"--tp-size {tp.size} is neither a divisor nor a multiple of the "
                         f"model's {num_kv_heads} KV heads ({num_heads} query heads)")
    else:
        kv_start, kv_count = tp.rank // (tp.size // num_kv_heads), 1
    return HeadShare(q_start, q_count, kv_start, kv_count)
