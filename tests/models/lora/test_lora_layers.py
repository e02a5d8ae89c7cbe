"""Tests of radixlm/models/lora/lora_layers.py: a LoraProjection adds, for each row, its own
adapter's ``scaling * B (A x)`` (stacked shards, ranks below the pool's, projections an
adapter leaves alone, rows of no adapter), against a naive per-row sum."""

from __future__ import annotations

from dataclasses import astuple

import pytest
import torch
from fused_kernels import enable_or_skip

from radixlm.kernels.cpu_ops import fused_ops
from radixlm.models.lora.lora_layers import LoraBatch, LoraProjection, LoraShard, LoraState
from radixlm.models.lora.peft_adapter import LoraAdapter

HIDDEN = 16
# A stacked q|k|v projection: q 16 rows, k and v 8 each.
QKV = [LoraShard("q_proj", 0, 16), LoraShard("k_proj", 16, 8), LoraShard("v_proj", 24, 8)]


def adapter(name: str, seed: int, ranks: dict[str, int], layer: int = 0) -> LoraAdapter:
    """An adapter of ``ranks`` (projection -> rank) on ``layer``, scalings 0.5, 1, 1.5 ..."""
    generator = torch.Generator().manual_seed(seed)
    weights, scalings = {}, {}
    rows = {shard.name: shard.rows for shard in QKV}
    for i, (projection, rank) in enumerate(sorted(ranks.items())):
        weights[(layer, projection)] = (torch.randn(rank, HIDDEN, generator=generator),
                                        torch.randn(rows[projection], rank,
                                                    generator=generator))
        scalings[(layer, projection)] = 0.5 * (i + 1)
    return LoraAdapter(name, "/nowhere", max(ranks.values()), frozenset(ranks), weights,
                       scalings)


def naive(x: torch.Tensor, row_adapters: list[LoraAdapter | None], layer: int = 0):
    """Each row's term, projection by projection, into a (T, 32) output."""
    out = torch.zeros(x.shape[0], 32)
    for row, found in enumerate(row_adapters):
        if found is None:
            continue
        for projection, offset, count, _ in map(astuple, QKV):
            if (layer, projection) in found.weights:
                a, b = found.weights[(layer, projection)]
                out[row, offset : offset + count] += (found.scaling(layer, projection)
                                                      * (b @ (a @ x[row])))
    return out


def batch(slots_by_row: list[int]) -> LoraBatch:
    """Segments of consecutive rows of one slot."""
    starts, lens, slots = [], [], []
    for row, slot in enumerate(slots_by_row):
        if slots and slots[-1] == slot:
            lens[-1] += 1
        else:
            starts.append(row)
            lens.append(1)
            slots.append(slot)
    as_tensor = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return LoraBatch(as_tensor(starts), as_tensor(lens), as_tensor(slots), max(lens),
                     (starts, lens, slots))


@pytest.fixture(params=["kernels", "torch"])
def path(request, monkeypatch):
    """Each test runs with the fused kernels on (skipped where they cannot be built; torch's
    products refused, so the kernels' must serve) and off; the state before is restored
    after."""
    was_on = fused_ops.active() is not None
    try:
        if request.param == "kernels":
            enable_or_skip()

            def refused(*args):
                raise AssertionError("torch's products ran with the kernels on")

            monkeypatch.setattr(LoraProjection, "_add_by_adapter", refused)
        else:
            fused_ops.disable()
        yield request.param
    finally:
        if was_on:
            fused_ops.enable()
        else:
            fused_ops.disable()


@pytest.fixture
def projection(path):
    state = LoraState()
    return LoraProjection(state, 0, QKV, HIDDEN, 32, slots=3, max_rank=8,
                          dtype=torch.float32, device=torch.device("cpu"))


def test_each_row_gets_its_own_adapter_s_term(projection):
    adapters = [adapter("a", 1, {"q_proj": 8, "v_proj": 3}),
                adapter("b", 2, {"k_proj": 2}),
                adapter("c", 3, {"q_proj": 1, "k_proj": 4, "v_proj": 8})]
    for slot, found in enumerate(adapters):
        projection.load(slot, found)
    slots_by_row = [0, 0, -1, 2, 1, 1, 1, -1, 0, 2]
    x = torch.randn(len(slots_by_row), HIDDEN)
    base = torch.randn(len(slots_by_row), 32)
    y = base.clone()
    projection.state.batch = batch(slots_by_row)
    projection.add(x, y)
    want = base + naive(x, [adapters[s] if s >= 0 else None for s in slots_by_row])
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(y[2], base[2]) and torch.equal(y[7], base[7])


def test_no_batch_adds_nothing(projection):
    projection.load(0, adapter("a", 1, {"q_proj": 4}))
    y = torch.randn(3, 32)
    before = y.clone()
    projection.add(torch.randn(3, HIDDEN), y)
    assert torch.equal(y, before)


def test_reloading_a_slot_leaves_nothing_of_the_adapter_before(projection):
    projection.load(1, adapter("wide", 5, {"q_proj": 8, "k_proj": 8, "v_proj": 8}))
    narrow = adapter("narrow", 6, {"v_proj": 2})
    projection.load(1, narrow)
    x = torch.randn(4, HIDDEN)
    y = torch.zeros(4, 32)
    projection.state.batch = batch([1, 1, 1, 1])
    projection.add(x, y)
    torch.testing.assert_close(y, naive(x, [narrow] * 4), atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(y[:, :24]) == 0


def test_an_adapter_of_another_layer_adds_nothing_here(projection):
    projection.load(0, adapter("elsewhere", 7, {"q_proj": 4}, layer=1))
    y = torch.zeros(2, 32)
    projection.state.batch = batch([0, 0])
    projection.add(torch.randn(2, HIDDEN), y)
    assert torch.count_nonzero(y) == 0
