"""Many LoRA adapters in one batch: the low-rank terms as segmented gather matmuls (SGMV).

A batch's rows are grouped into segments; segment g is rows
``[seg_starts[g], seg_starts[g] + seg_lens[g])`` and uses the adapter in slot ``seg_slots[g]``
of the stacked buffers (-1: no adapter). With A (S, R, K) and B (S, N, R) stacked by slot and
zero-padded past each adapter's rank, the LoRA term of a linear layer is two products
(Punica, Chen et al. 2023; S-LoRA, Sheng et al. 2023):

    lora_shrink:  xa[rows of g] = x[rows of g] @ A[slot].T                      (T, R)
    lora_expand:  out[rows of g, off:off+N] += scaling[slot] * xa[rows of g] @ B[slot].T
    lora_apply:   the two in turn

Two implementations of the same functions live here: Triton kernels (CUDA tensors, or CPU
tensors under Triton's interpreter) and a torch loop over segments, two matmuls each (CPU
tensors otherwise). ``uses_triton`` makes the choice; ``use_triton`` overrides it. Triton is
imported and the kernels decorated on first use, so ``TRITON_INTERPRET=1`` in the
environment by then (and before anything else imports Triton) puts them under the
interpreter, for the process's lifetime.

Triton grid: (segment, column block, row program). A program skips a slot -1 segment at
once, else takes the segment's rows in BLOCK_M tiles ``p, p + P, p + 2P, ...`` (P row
programs), so any P is correct for any segment lengths. P comes from ``max_seg_len``, a
Python int bound on ``seg_lens`` known to the caller (``cdiv(max_seg_len, BLOCK_M)``; None:
P = 1, one program loops over a segment's every row). The kernels read the segment table
only on the device: no host syncs, so a call can be captured in a CUDA graph, and a bound
that is too small for a replayed batch costs time, never correctness. The torch loop reads
the table on the host (a sync on a GPU); it is the CPU path, and the CUDA test's reference.

Products sum in float32: float32 inputs multiply in IEEE float32; float16 and bfloat16 ones
are widened to float32 and multiplied in TF32, which holds their products exactly (and
Triton's interpreter multiplies bfloat16 tiles wrongly). Results are rounded once, to the
inputs' dtype; ``lora_apply`` rounds xa too, as the two calls do.

Caller's contract, unchecked on the Triton path (checking would sync): ``0 <= seg_starts``,
``seg_starts + seg_lens <= T``, ``-1 <= seg_slots < S``, segments that ``lora_expand``
writes do not overlap. Rows in no segment, and rows of slot -1 segments, are left as they are.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

# Imported by ``_jit_kernels``: model layers import this module at start-up for its torch path,
# and Triton fixes its interpreter choice (TRITON_INTERPRET) when ``triton`` is imported and
# when a kernel is decorated. Triton is the optional 'gpu' extra; the torch path needs none.
triton = tl = None

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_RANK = 128


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _shrink_kernel(
    x_ptr, a_ptr, xa_ptr, seg_starts_ptr, seg_lens_ptr, seg_slots_ptr,
    num_rows, K, R,
    stride_xt, stride_xk, stride_as, stride_ar, stride_ak, stride_ot, stride_or,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid (segment, block of BLOCK_R rank columns, row program): xa = x @ A[slot].T."""
    g = tl.program_id(0)
    block_r = tl.program_id(1)
    row_program = tl.program_id(2)
    row_programs = tl.num_programs(2)
    slot = tl.load(seg_slots_ptr + g).to(tl.int64)
    if slot < 0:
        return
    start = tl.load(seg_starts_ptr + g).to(tl.int64)
    seg_len = tl.load(seg_lens_ptr + g).to(tl.int64)
    offs_r = block_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    a_base = a_ptr + slot * stride_as
    for m0 in range(row_program * BLOCK_M, seg_len, row_programs * BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        rows = start + offs_m
        m_mask = (offs_m < seg_len) & (rows < num_rows)
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            x = tl.load(
                x_ptr + rows[:, None] * stride_xt + offs_k[None, :] * stride_xk,
                mask=m_mask[:, None] & k_mask[None, :], other=0.0,
            )  # (M, K)
            a = tl.load(
                a_base + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak,
                mask=k_mask[:, None] & r_mask[None, :], other=0.0,
            )  # (K, R)
            acc += tl.dot(x.to(tl.float32), a.to(tl.float32),
                          input_precision=DOT_PRECISION)
        tl.store(
            xa_ptr + rows[:, None] * stride_ot + offs_r[None, :] * stride_or,
            acc.to(xa_ptr.dtype.element_ty), mask=m_mask[:, None] & r_mask[None, :],
        )


def _expand_kernel(
    xa_ptr, b_ptr, out_ptr, scaling_ptr, seg_starts_ptr, seg_lens_ptr, seg_slots_ptr,
    num_rows, N, R,
    stride_xt, stride_xr, stride_bs, stride_bn, stride_br, stride_ot, stride_on,
    stride_scaling,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid (segment, block of BLOCK_N output columns, row program):
    out += scale * xa @ B[slot].T, the whole rank in one tile."""
    g = tl.program_id(0)
    block_n = tl.program_id(1)
    row_program = tl.program_id(2)
    row_programs = tl.num_programs(2)
    slot = tl.load(seg_slots_ptr + g).to(tl.int64)
    if slot < 0:
        return
    start = tl.load(seg_starts_ptr + g).to(tl.int64)
    seg_len = tl.load(seg_lens_ptr + g).to(tl.int64)
    scale = tl.load(scaling_ptr + slot * stride_scaling).to(tl.float32)
    offs_n = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_r = tl.arange(0, BLOCK_R)  # the whole rank: R <= MAX_RANK
    r_mask = offs_r < R
    b = tl.load(
        b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br,
        mask=r_mask[:, None] & n_mask[None, :], other=0.0,
    ).to(tl.float32)  # (R, N), the same for every row tile of the segment
    for m0 in range(row_program * BLOCK_M, seg_len, row_programs * BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        rows = start + offs_m
        m_mask = (offs_m < seg_len) & (rows < num_rows)
        xa = tl.load(
            xa_ptr + rows[:, None] * stride_xt + offs_r[None, :] * stride_xr,
            mask=m_mask[:, None] & r_mask[None, :], other=0.0,
        )  # (M, R)
        delta = tl.dot(xa.to(tl.float32), b, input_precision=DOT_PRECISION) * scale
        out_tile = out_ptr + rows[:, None] * stride_ot + offs_n[None, :] * stride_on
        tile_mask = m_mask[:, None] & n_mask[None, :]
        acc = tl.load(out_tile, mask=tile_mask, other=0.0).to(tl.float32) + delta
        tl.store(out_tile, acc.to(out_ptr.dtype.element_ty), mask=tile_mask)


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _jit_kernels() -> tuple:
    """(shrink, expand), imported and decorated on first use (see the imports)."""
    global triton, tl
    import triton
    import triton.language as tl

    return triton.jit(_shrink_kernel), triton.jit(_expand_kernel)


def kernels_interpreted() -> bool:
    """True when this module's Triton kernels run under Triton's interpreter (on the CPU)."""
    if not triton_installed():
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_jit_kernels()[0], InterpretedFunction)


def uses_triton(device: torch.device, use_triton: bool | None = None) -> bool:
    """Whether tensors on ``device`` go through the Triton kernels (else the torch loop).

    None chooses: CUDA -> Triton; CPU -> Triton only under the interpreter; else torch.
    True on a device Triton cannot run on raises ValueError, saying what would.
    """
    if use_triton is None:
        return triton_installed() and (
            device.type == "cuda" or (device.type == "cpu" and kernels_interpreted())
        )
    if use_triton:
        if not triton_installed():
            raise ValueError("use_triton=True needs the triton package "
                             "(pip install 'radixlm[gpu]' or pip install triton)")
        if device.type != "cuda" and not (device.type == "cpu" and kernels_interpreted()):
            raise ValueError(
                f"use_triton=True needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 "
                f"set before Triton is first imported; the tensors are on {device}")
    return use_triton


def _check_segments(seg_starts, seg_lens, seg_slots, device: torch.device) -> None:
    for name, seg in (("seg_starts", seg_starts), ("seg_lens", seg_lens),
                      ("seg_slots", seg_slots)):
        if seg.dim() != 1 or seg.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a 1-D int32 or int64 tensor, "
                             f"got {seg.dtype} {tuple(seg.shape)}")
        if seg.device != device:
            raise ValueError(f"{name} is on {seg.device}, the activations on {device}")
        if seg.numel() != seg_starts.numel():
            raise ValueError(f"seg_starts, seg_lens and seg_slots must have one entry per "
                             f"segment, got {seg_starts.numel()}, {seg_lens.numel()}, "
                             f"{seg_slots.numel()}")


def _check_stacked(name: str, weights: torch.Tensor, dtype: torch.dtype, shape: tuple) -> None:
    """``shape`` holds None where any size goes."""
    if weights.dim() != 3 or any(
        want is not None and got != want for got, want in zip(weights.shape, shape)
    ):
        wanted = ", ".join("*" if s is None else str(s) for s in shape)
        raise ValueError(f"{name} must be ({wanted}), got {tuple(weights.shape)}")
    if weights.dtype != dtype:
        raise ValueError(f"{name} is {weights.dtype}, the activations {dtype}")


def _check_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def _check_rank(rank: int) -> None:
    if not 0 < rank <= MAX_RANK:
        raise ValueError(f"the stacked rank R must be in 1..{MAX_RANK}, got {rank}")


def _segments_on_host(seg_starts, seg_lens, seg_slots, num_rows: int, num_slots: int):
    """The segment table as Python lists (the torch path's one host read), checked."""
    table = list(zip(seg_starts.tolist(), seg_lens.tolist(), seg_slots.tolist()))
    for g, (start, length, slot) in enumerate(table):
        if start < 0 or length < 0 or start + length > num_rows:
            raise ValueError(f"segment {g} is rows [{start}, {start + length}), "
                             f"outside the batch's {num_rows} rows")
        if not -1 <= slot < num_slots:
            raise ValueError(f"segment {g} uses slot {slot}; slots are -1..{num_slots - 1}")
    return table


def _row_programs(max_seg_len: int | None, block_m: int) -> int:
    if max_seg_len is None:
        return 1
    if max_seg_len < 0:
        raise ValueError(f"max_seg_len must be >= 0, got {max_seg_len}")
    return max(1, _cdiv(max_seg_len, block_m))


def _block_m(max_seg_len: int | None) -> int:
    """Short segments (decode) waste less of a small tile; long ones (prefill) want a big one."""
    return 16 if max_seg_len is not None and max_seg_len <= 16 else 64


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def lora_shrink(
    x: torch.Tensor, a: torch.Tensor,
    seg_starts: torch.Tensor, seg_lens: torch.Tensor, seg_slots: torch.Tensor,
    out: torch.Tensor | None = None,
    *, max_seg_len: int | None = None, use_triton: bool | None = None,
) -> torch.Tensor:
    """x (T, K) @ each segment's A[slot].T -> xa (T, R) in x's dtype; a (S, R, K).

    ``out`` (T, R), if given, is written and returned; otherwise a zeroed one is, so rows of
    slot -1 segments and rows in no segment are 0 there. ``max_seg_len``: see the module.
    """
    _check_dtype("x", x)
    if x.dim() != 2:
        raise ValueError(f"x must be (T, K), got {tuple(x.shape)}")
    num_rows, k = x.shape
    _check_stacked("a", a, x.dtype, (None, None, k))
    num_slots, rank, _ = a.shape
    _check_rank(rank)
    _check_segments(seg_starts, seg_lens, seg_slots, x.device)
    if out is None:
        out = torch.zeros(num_rows, rank, dtype=x.dtype, device=x.device)
    elif out.shape != (num_rows, rank) or out.dtype != x.dtype:
        raise ValueError(f"out must be {x.dtype} ({num_rows}, {rank}), "
                         f"got {out.dtype} {tuple(out.shape)}")
    if not uses_triton(x.device, use_triton):
        table = _segments_on_host(seg_starts, seg_lens, seg_slots, num_rows, num_slots)
        for start, length, slot in table:
            if slot >= 0 and length > 0:
                rows = slice(start, start + length)
                out[rows] = x[rows] @ a[slot].T
        return out
    if num_rows == 0 or seg_slots.numel() == 0:
        return out
    block_m = _block_m(max_seg_len)
    block_r = max(16, min(_next_power_of_2(rank), 64))
    grid = (seg_slots.numel(), _cdiv(rank, block_r), _row_programs(max_seg_len, block_m))
    shrink_kernel, _ = _jit_kernels()
    shrink_kernel[grid](
        x, a, out, seg_starts, seg_lens, seg_slots,
        num_rows, k, rank,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2),
        out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=64, DOT_PRECISION=_dot_precision(x.dtype),
    )
    return out


def lora_expand(
    xa: torch.Tensor, b: torch.Tensor,
    seg_starts: torch.Tensor, seg_lens: torch.Tensor, seg_slots: torch.Tensor,
    scaling: torch.Tensor, out: torch.Tensor, out_offset: int = 0,
    *, max_seg_len: int | None = None, use_triton: bool | None = None,
) -> None:
    """out[rows of g, out_offset:out_offset + N] += scaling[slot] * xa[rows of g] @ B[slot].T,
    in place; xa (T, R), b (S, N, R), scaling (S,) float32, out (T, M) in xa's dtype, any
    strides (a view into a stacked q/k/v output, say). Rows of slot -1 are untouched."""
    _check_dtype("xa", xa)
    if xa.dim() != 2:
        raise ValueError(f"xa must be (T, R), got {tuple(xa.shape)}")
    num_rows, rank = xa.shape
    _check_rank(rank)
    _check_stacked("b", b, xa.dtype, (None, None, rank))
    num_slots, n, _ = b.shape
    if scaling.shape != (num_slots,) or scaling.dtype != torch.float32:
        raise ValueError(f"scaling must be float32 ({num_slots},), one per slot, "
                         f"got {scaling.dtype} {tuple(scaling.shape)}")
    if scaling.device != xa.device:
        raise ValueError(f"scaling is on {scaling.device}, xa on {xa.device}")
    if out.dim() != 2 or out.shape[0] != num_rows or out.dtype != xa.dtype:
        raise ValueError(f"out must be {xa.dtype} ({num_rows}, M), "
                         f"got {out.dtype} {tuple(out.shape)}")
    if not 0 <= out_offset <= out.shape[1] - n:
        raise ValueError(f"out_offset {out_offset} + N {n} does not fit out's "
                         f"{out.shape[1]} columns")
    _check_segments(seg_starts, seg_lens, seg_slots, xa.device)
    target = out[:, out_offset:out_offset + n]  # (T, N), a view: writes land in out
    if not uses_triton(xa.device, use_triton):
        table = _segments_on_host(seg_starts, seg_lens, seg_slots, num_rows, num_slots)
        scales = scaling.tolist()
        for start, length, slot in table:
            if slot >= 0 and length > 0:
                rows = slice(start, start + length)
                target[rows].addmm_(xa[rows], b[slot].T, alpha=scales[slot])
        return
    if num_rows == 0 or n == 0 or seg_slots.numel() == 0:
        return
    block_m = _block_m(max_seg_len)
    # float32 at rank 128 would need 100 KiB of shared memory at 64 columns: past the
    # 99 KiB a block gets on sm_86 and sm_89
    block_n = 32 if xa.dtype == torch.float32 and rank > 64 else 64
    grid = (seg_slots.numel(), _cdiv(n, block_n), _row_programs(max_seg_len, block_m))
    _, expand_kernel = _jit_kernels()
    expand_kernel[grid](
        xa, b, target, scaling, seg_starts, seg_lens, seg_slots,
        num_rows, n, rank,
        xa.stride(0), xa.stride(1), b.stride(0), b.stride(1), b.stride(2),
        target.stride(0), target.stride(1), scaling.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=max(16, _next_power_of_2(rank)),
        DOT_PRECISION=_dot_precision(xa.dtype),
    )


def lora_apply(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    seg_starts: torch.Tensor, seg_lens: torch.Tensor, seg_slots: torch.Tensor,
    scaling: torch.Tensor, out: torch.Tensor, out_offset: int = 0,
    *, max_seg_len: int | None = None, use_triton: bool | None = None,
) -> None:
    """out[rows of g, out_offset:out_offset + N] += scaling[slot] * x @ A[slot].T @ B[slot].T:
    ``lora_shrink`` then ``lora_expand`` (xa rounded to x's dtype in between)."""
    xa = lora_shrink(x, a, seg_starts, seg_lens, seg_slots,
                     max_seg_len=max_seg_len, use_triton=use_triton)
    lora_expand(xa, b, seg_starts, seg_lens, seg_slots, scaling, out, out_offset,
                max_seg_len=max_seg_len, use_triton=use_triton)
