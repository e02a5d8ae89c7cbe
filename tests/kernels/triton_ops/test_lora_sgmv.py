"""The SGMV LoRA functions (triton_ops/lora_sgmv.py), both paths, against a naive per-row
float64 reference: each row looks up its segment's slot and multiplies.

The batch mixes one-row and long segments (longer than a 64-row tile), slot -1 segments, an
empty segment, slots used by several segments and rows in no segment; K, N and R are not
multiples of the tiles. The torch path runs on the CPU; the Triton path on
``KERNEL_DEVICE`` (Triton's interpreter on CPUs, set up by ``conftest.py``). Errors are
bounded by the dtype's precision times the sum of |terms| of each output.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from kernel_device import KERNEL_DEVICE

from radixlm.kernels.triton_ops.lora_sgmv import (
    kernels_interpreted,
    lora_apply,
    lora_expand,
    lora_shrink,
    uses_triton,
)

# (rows, slot) in order; None: rows in no segment.
SEGMENTS = [(1, 0), (3, -1), (70, 2), (1, 0), (0, 1), (2, -1), (20, 1), (2, None), (5, 2)]
NUM_SLOTS = 3
SHAPES = [(40, 24, 8), (130, 70, 16), (33, 17, 128)]  # (K, N, R)
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = list(TOLERANCE)
PATHS = [
    pytest.param(False, id="torch"),
    pytest.param(True, id="triton", marks=pytest.mark.triton),
]


def segment_table(segments=SEGMENTS, index_dtype=torch.int32):
    """(seg_starts, seg_lens, seg_slots, slot of each row (-1: none), rows)."""
    starts, lens, slots, row_slots = [], [], [], []
    row = 0
    for length, slot in segments:
        if slot is not None:
            starts.append(row)
            lens.append(length)
            slots.append(slot)
        row_slots += [-1 if slot is None else slot] * length
        row += length
    table = [torch.tensor(v, dtype=index_dtype) for v in (starts, lens, slots)]
    return (*table, row_slots, row)


def random_weights(k, n, r, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(NUM_SLOTS, r, k, generator=gen) * 0.1).to(dtype)
    b = (torch.randn(NUM_SLOTS, n, r, generator=gen) * 0.1).to(dtype)
    scaling = torch.rand(NUM_SLOTS, generator=gen) + 0.5
    return a, b, scaling, gen


def naive_shrink(x, a, row_slots):
    """(xa, sum of |terms|) in float64, row by row; rows without an adapter 0."""
    xa = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64)
    magnitude = torch.zeros_like(xa)
    for t, slot in enumerate(row_slots):
        if slot >= 0:
            xa[t] = x[t].double() @ a[slot].double().T
            magnitude[t] = x[t].double().abs() @ a[slot].double().abs().T
    return xa, magnitude


def naive_expand(xa, xa_magnitude, b, scaling, out, out_offset, row_slots):
    """(out after the update, sum of |terms|) in float64, row by row."""
    expected = out.double().clone()
    magnitude = out.double().abs()
    n = b.shape[1]
    for t, slot in enumerate(row_slots):
        if slot >= 0:
            cols = slice(out_offset, out_offset + n)
            s = float(scaling[slot])
            expected[t, cols] += s * (xa[t].double() @ b[slot].double().T)
            magnitude[t, cols] += s * (xa_magnitude[t] @ b[slot].double().abs().T)
    return expected, magnitude


def assert_within(got, expected, magnitude, dtype):
    error = (got.cpu().double() - expected).abs()
    bound = TOLERANCE[dtype] * magnitude + 1e-30
    assert (error <= bound).all(), f"worst error / bound {(error / bound).max():.3g}"


def stacked_qkv_out(num_rows, n, dtype, gen):
    """A strided (T, 3N) view (every other column of a wider buffer) and where k starts."""
    buffer = torch.randn(num_rows, 6 * n + 4, generator=gen).to(dtype)
    return buffer[:, 2::2], n


def to_device(use_triton, *tensors):
    device = KERNEL_DEVICE if use_triton else torch.device("cpu")
    return [t.to(device) for t in tensors]


@pytest.mark.parametrize("use_triton", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k, n, r", SHAPES)
def test_shrink_multiplies_each_segments_rows_by_its_slots_a(use_triton, dtype, k, n, r):
    starts, lens, slots, row_slots, num_rows = segment_table()
    a, _, _, gen = random_weights(k, n, r, dtype, seed=k + r)
    x = torch.randn(num_rows, k, generator=gen).to(dtype)
    expected, magnitude = naive_shrink(x, a, row_slots)
    xa = lora_shrink(*to_device(use_triton, x, a, starts, lens, slots), use_triton=use_triton)
    assert xa.shape == (num_rows, r) and xa.dtype == dtype
    assert_within(xa, expected, magnitude, dtype)
    no_adapter = torch.tensor(row_slots) < 0
    assert (xa.cpu()[no_adapter] == 0).all()


@pytest.mark.parametrize("use_triton", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k, n, r", SHAPES)
def test_expand_adds_the_scaled_b_product_into_a_strided_slice(use_triton, dtype, k, n, r):
    starts, lens, slots, row_slots, num_rows = segment_table(index_dtype=torch.int64)
    _, b, scaling, gen = random_weights(k, n, r, dtype, seed=n + r)
    xa = torch.randn(num_rows, r, generator=gen).to(dtype)
    out, out_offset = stacked_qkv_out(num_rows, n, dtype, gen)
    before = out.clone()
    expected, magnitude = naive_expand(xa, xa.double().abs(), b, scaling, out, out_offset,
                                       row_slots)
    # xa and scaling as column views too (one shard of a stacked q/k/v LoRA)
    xa = torch.cat([xa, torch.zeros_like(xa)], 1)[:, :r]
    scaling = torch.stack([scaling, -scaling], 1)[:, 0]
    xa, b, starts, lens, slots, scaling, out = to_device(
        use_triton, xa, b, starts, lens, slots, scaling, out)
    assert out.stride(1) == 2 and scaling.stride(0) == 2 and not xa.is_contiguous()
    lora_expand(xa, b, starts, lens, slots, scaling, out, out_offset, use_triton=use_triton)
    assert_within(out, expected, magnitude, dtype)
    untouched = out.cpu().clone()
    untouched[:, out_offset:out_offset + n][torch.tensor(row_slots) >= 0] = 0
    before[:, out_offset:out_offset + n][torch.tensor(row_slots) >= 0] = 0
    assert torch.equal(untouched, before)  # other columns, slot -1 rows, rows in no segment


@pytest.mark.parametrize("use_triton", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_apply_adds_the_lora_term_of_each_rows_adapter(use_triton, dtype):
    k, n, r = 130, 70, 16
    starts, lens, slots, row_slots, num_rows = segment_table()
    a, b, scaling, gen = random_weights(k, n, r, dtype, seed=7)
    x = torch.randn(num_rows, k, generator=gen).to(dtype)
    out, out_offset = stacked_qkv_out(num_rows, n, dtype, gen)
    xa, xa_magnitude = naive_shrink(x, a, row_slots)
    expected, magnitude = naive_expand(xa, xa_magnitude, b, scaling, out, out_offset,
                                       row_slots)
    x, a, b, starts, lens, slots, scaling, out = to_device(
        use_triton, x, a, b, starts, lens, slots, scaling, out)
    lora_apply(x, a, b, starts, lens, slots, scaling, out, out_offset, use_triton=use_triton)
    assert_within(out, expected, magnitude, dtype)


@pytest.mark.triton
@pytest.mark.parametrize("max_seg_len", [None, 1, 16, 70, 200],
                         ids=["one_program_per_segment", "too_small", "tile", "exact", "loose"])
def test_the_kernels_are_right_for_any_max_seg_len(max_seg_len):
    k, n, r = 40, 24, 8
    starts, lens, slots, row_slots, num_rows = segment_table()
    a, b, scaling, gen = random_weights(k, n, r, torch.float32, seed=3)
    x = torch.randn(num_rows, k, generator=gen)
    out = torch.randn(num_rows, n, generator=gen)
    xa, xa_magnitude = naive_shrink(x, a, row_slots)
    expected, magnitude = naive_expand(xa, xa_magnitude, b, scaling, out, 0, row_slots)
    x, a, b, starts, lens, slots, scaling, out = to_device(
        True, x, a, b, starts, lens, slots, scaling, out)
    lora_apply(x, a, b, starts, lens, slots, scaling, out, max_seg_len=max_seg_len,
               use_triton=True)
    assert_within(out, expected, magnitude, torch.float32)


@pytest.mark.parametrize("use_triton", PATHS)
def test_an_empty_batch_or_no_segments_change_nothing(use_triton):
    a, b, scaling, _ = random_weights(16, 8, 4, torch.float32, seed=0)
    none = torch.zeros(0, dtype=torch.int32)
    x, a, b, scaling, none = to_device(use_triton, torch.zeros(0, 16), a, b, scaling, none)
    assert lora_shrink(x, a, none, none, none, use_triton=use_triton).shape == (0, 4)
    out = torch.ones(3, 8, device=x.device)
    lora_apply(torch.ones(3, 16, device=x.device), a, b, none, none, none, scaling, out,
               use_triton=use_triton)
    assert (out == 1).all()


def test_cpu_tensors_take_the_triton_path_only_under_the_interpreter():
    assert uses_triton(torch.device("cpu")) == kernels_interpreted()
    assert not uses_triton(torch.device("cpu"), use_triton=False)


def test_without_the_interpreter_cpu_tensors_take_the_torch_path():
    script = (
        "import torch\n"
        "from radixlm.kernels.triton_ops.lora_sgmv import lora_shrink, uses_triton\n"
        "assert not uses_triton(torch.device('cpu'))\n"
        "x, a = torch.ones(3, 4), torch.ones(2, 2, 4)\n"
        "seg = torch.tensor([0, 3]), torch.tensor([3, 0]), torch.tensor([1, 0])\n"
        "assert (lora_shrink(x, a, *seg) == 4).all()\n"
        "try:\n"
        "    uses_triton(torch.device('cpu'), use_triton=True)\n"
        "except ValueError as e:\n"
        "    assert 'TRITON_INTERPRET=1' in str(e)\n"
        "else:\n"
        "    raise AssertionError('use_triton=True on a CPU without the interpreter')\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x, a, b, seg, s, out: lora_shrink(x.double(), a.double(), *seg),
         "float32, float16 or bfloat16"),
        (lambda x, a, b, seg, s, out: lora_shrink(x, torch.zeros(3, 129, 16), *seg),
         r"rank R must be in 1\.\.128"),
        (lambda x, a, b, seg, s, out: lora_shrink(x, a[:, :, :8], *seg),
         r"a must be \(\*, \*, 16\)"),
        (lambda x, a, b, seg, s, out: lora_shrink(x, a, seg[0], seg[1][:1], seg[2]),
         "one entry per segment"),
        (lambda x, a, b, seg, s, out: lora_shrink(x, a, seg[0], seg[1], seg[2].float()),
         "seg_slots must be a 1-D int32 or int64"),
        (lambda x, a, b, seg, s, out: lora_shrink(
            x, a, seg[0], seg[1] + 1, seg[2], use_triton=False), "outside the batch's 5 rows"),
        (lambda x, a, b, seg, s, out: lora_shrink(
            x, a, seg[0], seg[1], seg[2] + 3, use_triton=False), r"slots are -1\.\.2"),
        (lambda x, a, b, seg, s, out: lora_expand(x[:, :4], b, *seg, s.half(), out),
         "scaling must be float32"),
        (lambda x, a, b, seg, s, out: lora_expand(x[:, :4], b, *seg, s, out, out_offset=5),
         "does not fit out's 12 columns"),
    ],
    ids=["dtype", "rank", "a_shape", "segment_lengths", "slot_dtype", "rows", "slot",
         "scaling", "out_offset"],
)
def test_bad_arguments_are_refused_naming_the_argument(call, match):
    x, a = torch.zeros(5, 16), torch.zeros(3, 4, 16)
    b, scaling, out = torch.zeros(3, 8, 4), torch.ones(3), torch.zeros(5, 12)
    seg = torch.tensor([0, 2]), torch.tensor([2, 3]), torch.tensor([1, -1])
    with pytest.raises(ValueError, match=match):
        call(x, a, b, seg, scaling, out)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_cuda_kernels_match_the_torch_path(dtype):
    gen = torch.Generator().manual_seed(11)
    lengths = [1] * 40 + [7, 130, 1, 513, 64, 65]
    slot_of = torch.randint(-1, 6, (len(lengths),), generator=gen).tolist()
    starts, lens, slots, row_slots, num_rows = segment_table(list(zip(lengths, slot_of)))
    k, n, r = 1000, 1030, 64
    a = (torch.randn(6, r, k, generator=gen) * 0.05).to(dtype)
    b = (torch.randn(6, 3 * n, r, generator=gen) * 0.05).to(dtype)
    scaling = torch.rand(6, generator=gen)
    x = torch.randn(num_rows, k, generator=gen).to(dtype)
    out = torch.randn(num_rows, 3 * n + 8, generator=gen).to(dtype)
    cuda = [t.cuda() for t in (x, a, b, starts, lens, slots, scaling)]
    expected = out.cuda()
    lora_apply(*cuda, expected, 8, use_triton=False)
    for max_seg_len in (None, 513):
        got = out.cuda()
        lora_apply(*cuda, got, 8, max_seg_len=max_seg_len, use_triton=True)
        torch.cuda.synchronize()
        torch.testing.assert_close(got, expected, atol=2 * TOLERANCE[dtype],
                                   rtol=2 * TOLERANCE[dtype])
