"""The LoRA kernel (lora_matmul.cpp: ``lora_add``) adds each row's own adapter's terms to a
projection's output, float64's sum to float32 sums and the output's rounding, for shards whose
bounds and inputs are not whole vectors, ranks below the pool's (the padding past them never
read) and zero, scales of zero skipping their shard; leaves the rows of no adapter alone to the
bit; gives a row the same bits whatever rows, groups or threads are beside it, also when built
for CPUs other than this one that this one can run; and rejects operands that do not fit."""

from __future__ import annotations

import pytest
import torch
from fused_kernels import build_alone
from test_few_rows_matmul import OTHER_BUILDS

SLOTS, R = 3, 8
# (K, bounds): K past whole vectors of 8 and 16; shard bounds off the vector width (N = 100),
# one shard, and columns over more than one of the expand's chunks of columns (N = 300).
SHAPES = [(77, [0, 37, 61, 100]), (40, [0, 100]), (64, [0, 129, 257, 300])]
# Each slot's rank in each of up to three shards: below R, R, and 0.
RANKS = [[8, 3, 0], [5, 8, 2], [1, 0, 8]]
# Each slot's scale per shard: slot 1's last shard is 0 (skipped, though it has a rank);
# slot 0's last has a scale but rank 0.
SCALES = [[0.5, 2.0, 1.5], [1.25, -0.75, 0.0], [3.0, 0.5, 0.25]]


def operands(K: int, bounds: list[int], weight_type: torch.dtype, seed: int = 0) -> dict:
    """a, b_t, scales, ranks and bounds for SLOTS slots of rank R: random weights, NaN in
    what must never be read (the padding past a shard's rank, and the weights of a shard of
    scale 0), which would spread to the whole row's shard if it were."""
    generator = torch.Generator().manual_seed(seed)
    S, N = len(bounds) - 1, bounds[-1]
    a = torch.randn(SLOTS, S * R, K, generator=generator) / K ** 0.5
    b_t = torch.randn(SLOTS, R, N, generator=generator)
    for slot in range(SLOTS):
        for i in range(S):
            used = RANKS[slot][i] if SCALES[slot][i] else 0
            a[slot, i * R + used : (i + 1) * R] = float("nan")
            b_t[slot, used:, bounds[i] : bounds[i + 1]] = float("nan")
    return dict(
        a=a.to(weight_type), b_t=b_t.to(weight_type),
        scales=torch.tensor([row[:S] for row in SCALES], dtype=torch.float32),
        ranks=torch.tensor([row[:S] for row in RANKS], dtype=torch.int64),
        bounds=torch.tensor(bounds, dtype=torch.int64))


def call(module, x: torch.Tensor, y: torch.Tensor, groups: list[tuple[int, list[int]]],
         ops: dict) -> torch.Tensor:
    """y after ``lora_add`` of ``groups`` ((slot, rows) each), on a copy."""
    out = y.clone()
    rows = torch.tensor([r for _, found in groups for r in found], dtype=torch.int64)
    starts = [0]
    for _, found in groups:
        starts.append(starts[-1] + len(found))
    module.lora_add(x, out, rows, torch.tensor(starts, dtype=torch.int64),
                    torch.tensor([slot for slot, _ in groups], dtype=torch.int64),
                    ops["a"], ops["b_t"], ops["scales"], ops["ranks"], ops["bounds"])
    return out


def reference(x, y, groups, ops) -> tuple[torch.Tensor, torch.Tensor]:
    """float64's result, and the magnitude its float32 sums are held to (|y| + the sum of
    |scale| |x| |a| |b|)."""
    want, magnitude = y.double().clone(), y.double().abs()
    bounds = ops["bounds"].tolist()
    for slot, found in groups:
        for i in range(len(bounds) - 1):
            scale, rank = float(ops["scales"][slot, i]), int(ops["ranks"][slot, i])
            if scale == 0:
                continue
            c0, c1 = bounds[i], bounds[i + 1]
            a = ops["a"][slot, i * R : i * R + rank].double()  # (rank, K)
            b = ops["b_t"][slot, :rank, c0:c1].double()  # (rank, columns)
            for row in found:
                xr = x[row].double()
                want[row, c0:c1] += scale * ((a @ xr) @ b)
                magnitude[row, c0:c1] += abs(scale) * ((a.abs() @ xr.abs()) @ b.abs())
    return want, magnitude


STEP = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
"""Half a step of the output's type, relative (its rounding); float32's is in the sums'."""

ROWS_BY_SLOT = [0, 2, -1, 1, 0, 0, 2, -1, 1, 1, 2, 0, -1, 0, 1]  # interleaved, some of none


def groups_of(slots_by_row: list[int]) -> list[tuple[int, list[int]]]:
    by_slot: dict[int, list[int]] = {}
    for row, slot in enumerate(slots_by_row):
        if slot >= 0:
            by_slot.setdefault(slot, []).append(row)
    return sorted(by_slot.items(), key=lambda item: -item[0])  # not in slot order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weights", ["x's", "float32"])
@pytest.mark.parametrize("K, bounds", SHAPES)
def test_lora_add_adds_float64_s_terms_to_the_rows_of_an_adapter(kernels, dtype, weights, K,
                                                                 bounds):
    """Within float32 sums (1e-5 of the magnitude) and, for 16-bit outputs, one rounding of
    the result; rows of no adapter keep their bits."""
    weight_type = dtype if weights == "x's" else torch.float32
    ops = operands(K, bounds, weight_type, seed=K)
    torch.manual_seed(K + len(bounds))
    x = torch.randn(len(ROWS_BY_SLOT), 2 * K).to(dtype)[:, 3 : 3 + K]  # rows K + 3 apart
    y = torch.randn(len(ROWS_BY_SLOT), bounds[-1]).to(dtype)
    groups = groups_of(ROWS_BY_SLOT)
    got = call(kernels, x, y, groups, ops)
    assert torch.equal(call(kernels, x.contiguous(), y, groups, ops), got)
    assert got.dtype == dtype and got.shape == y.shape
    want, magnitude = reference(x, y, groups, ops)
    error = (got.double() - want).abs()
    allowed = 1e-5 * magnitude + 2 * STEP[dtype] * want.abs() + 1e-30
    assert (error <= allowed).all(), float((error - allowed).max())
    for row, slot in enumerate(ROWS_BY_SLOT):
        if slot < 0:
            assert torch.equal(got[row], y[row]), row
    # the terms are there: the result is not y where an adapter adapts a shard
    assert not torch.equal(got[0, : bounds[1]], y[0, : bounds[1]])


def test_zero_scales_and_ranks_leave_their_shards_alone(kernels):
    """Slot 1's third shard (scale 0, rank 2) and slot 0's (rank 0) add nothing, to the
    bit; the shards beside them do add. A pass of no rows, or no groups, or a group of no
    rows, changes nothing."""
    K, bounds = SHAPES[0]
    ops = operands(K, bounds, torch.float32)
    x, y = torch.randn(6, K), torch.randn(6, bounds[-1])
    got = call(kernels, x, y, [(1, [0, 1, 2]), (0, [3, 4, 5])], ops)
    assert torch.equal(got[:, bounds[2]:], y[:, bounds[2]:])
    assert (got[:, : bounds[2]] != y[:, : bounds[2]]).all()
    assert torch.equal(call(kernels, x, y, [], ops), y)
    assert call(kernels, x[:0], y[:0], [], ops).shape == (0, bounds[-1])
    assert torch.equal(call(kernels, x, y, [(2, []), (1, [0, 1, 2]), (0, [3, 4, 5])], ops),
                       got)


@pytest.mark.parametrize("dtype, weight_type", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32), (torch.float16, torch.float16)])
@pytest.mark.parametrize("K, bounds", [SHAPES[0], SHAPES[2]])
def test_lora_add_gives_a_row_the_same_bits_in_any_pass(kernels, dtype, weight_type, K,
                                                        bounds):
    check_rows_independent(kernels, dtype, weight_type, K, bounds)


def check_rows_independent(module, dtype, weight_type, K, bounds) -> None:
    """A row's result depends on its own x, slot and weights only: alone, in a group of 7
    (blocks of 4 and a rest of 3), grouped otherwise, among other adapters' groups, and on 1
    or 2 threads, bit for bit."""
    ops = operands(K, bounds, weight_type, seed=5)
    torch.manual_seed(11)
    x = torch.randn(9, K).to(dtype)
    y = torch.randn(9, bounds[-1]).to(dtype)
    seven = [(2, [0, 1, 2, 3, 4, 5, 6])]
    whole = call(module, x, y, seven, ops)
    passes = [
        [(2, [row]) for row in range(7)],  # each alone (its own group)
        [(2, [6, 5, 4, 3, 2, 1, 0])],  # the group in another order
        [(2, [3, 4]), (2, [0, 1, 2]), (2, [5, 6])],  # split into groups of one slot
        [(0, [7]), (2, [5, 0, 3, 6]), (1, [8]), (2, [1, 2, 4])],  # beside other adapters
    ]
    for groups in passes:
        got = call(module, x, y, groups, ops)
        assert torch.equal(got[:7], whole[:7]), groups
    for row in (0, 4, 6):
        alone = call(module, x[row : row + 1], y[row : row + 1], [(2, [0])], ops)
        assert torch.equal(alone[0], whole[row]), row
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = call(module, x, y, seven, ops)
        torch.set_num_threads(2)
        two = call(module, x, y, seven, ops)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, whole) and torch.equal(two, whole)


# The kernel's module, without the others.
LORA_BINDINGS = """
#include <torch/extension.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lora_add", torch::wrap_pybind_function(lora_add), "lora_add");
}
"""


@pytest.fixture(scope="module", params=sorted(OTHER_BUILDS))
def other_build(request):
    """lora_matmul.cpp alone, built for another CPU this one can run (skipped where it
    cannot, or where no compiler or ninja is found), in a directory removed afterwards."""
    yield from build_alone(request, OTHER_BUILDS, "lora_matmul.cpp", LORA_BINDINGS)


@pytest.mark.slow
@pytest.mark.parametrize("dtype, weight_type", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float32)])
def test_a_build_for_another_cpu_adds_the_terms_the_same_way(other_build, dtype, weight_type):
    K, bounds = SHAPES[0]
    check_rows_independent(other_build, dtype, weight_type, K, bounds)
    ops = operands(K, bounds, weight_type, seed=K)
    x = torch.randn(len(ROWS_BY_SLOT), K).to(dtype)
    y = torch.randn(len(ROWS_BY_SLOT), bounds[-1]).to(dtype)
    groups = groups_of(ROWS_BY_SLOT)
    got = call(other_build, x, y, groups, ops)
    want, magnitude = reference(x, y, groups, ops)
    allowed = 1e-5 * magnitude + 2 * STEP[dtype] * want.abs() + 1e-30
    assert ((got.double() - want).abs() <= allowed).all()
    assert all(torch.equal(got[row], y[row]) for row, s in enumerate(ROWS_BY_SLOT) if s < 0)


def test_lora_add_rejects_operands_that_do_not_fit(kernels):
    K, bounds = SHAPES[0]
    ops = operands(K, bounds, torch.float32)
    x, y = torch.randn(4, K), torch.randn(4, bounds[-1])
    long = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
    good = dict(x=x, y=y, rows=long([0, 1, 3]), starts=long([0, 2, 3]), slots=long([0, 2]),
                **ops)

    def rejects(message: str, **changed) -> None:
        args = {**good, **changed}
        before = args["y"].clone()
        with pytest.raises(RuntimeError, match=f"^lora_add: {message}"):
            kernels.lora_add(*args.values())
        assert torch.equal(args["y"], before)  # nothing written

    kernels.lora_add(*{**good, "y": y.clone()}.values())  # these fit
    rejects("row out of range", rows=long([0, 1, 4]))
    rejects("row out of range", rows=long([0, -1, 3]))
    rejects("slot out of range", slots=long([0, SLOTS]))
    rejects("slot out of range", slots=long([-1, 2]))
    rejects(r"ranks must lie in \[0, R\]", ranks=ops["ranks"].clone().fill_(R + 1))
    rejects("bounds must run from 0 to N", bounds=long([0, 37, 61, 99]))
    rejects("b_t must be a contiguous", b_t=ops["b_t"].bfloat16())
    rejects("y must be a contiguous", y=torch.randn(4, 2 * bounds[-1])[:, ::2])
    rejects("a and b_t must be float32 or x's type", a=ops["a"].double(),
            b_t=ops["b_t"].double())
    rejects("starts must cover rows", starts=long([0, 2, 2]))
    rejects("scales", scales=ops["scales"].double())
