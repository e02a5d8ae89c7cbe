"""Compiles every radixlm Triton kernel for NVIDIA GPUs (sm_80, sm_86, sm_89, sm_90) without one.

The interpreter runs kernels as numpy and misses what only the compiler checks (types of
loop-carried values, tensor-core tile minimums, constexpr use, shared memory). This script
runs each kernel's Python wrapper on small CPU tensors with the kernels' launch replaced by
a recorder and the device's shared memory replaced by the target's
(``tile_plan.SHARED_MEMORY_PER_BLOCK``), so the wrappers choose the tiles they would choose
on that GPU; then it compiles every recorded launch, with its real arguments' types, to a
cubin through Triton's own compiler (``triton.compile`` with an explicit target).

Shapes: the default model's (SmolLM2-135M: 9 heads over 3 KV heads of 64, plus the same
heads with a sliding window, a logit softcap and a slot map), Llama-8B's (32 over 8 of
128), DeepSeek-V2's MLA (16 heads, a 512 + 64 latent row; keys 576 wide, values 512) and a
fused MoE, each at the tiles the Triton backend asks for on a GPU (``TritonBackendConfig``).

A kernel fails when it does not compile, when it needs more shared memory than the
target gives a block, or more than ``tile_plan`` estimated for its tiles (the estimate the
tiles were chosen by). A wrapper refusing a launch (float32 MLA prefill on a 99 KiB GPU) is
reported and allowed in float32 only. ``--unplanned`` launches at the tiles asked for,
without the plan (what the wrappers did before issue 58), to show the check refusing them.

Run with TRITON_INTERPRET unset; prints one line per compiled kernel, exits 1 on any
failure:

    python tests/kernels/gpu_compile_check.py --arch 80,86,89,90 bfloat16 float32
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

assert not os.environ.get("TRITON_INTERPRET"), "compile checks need the real Triton compiler"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from radixlm.kernels.triton_ops import decode_attention as triton_decode_attention  # noqa: E402
from radixlm.kernels.triton_ops import extend_attention as triton_extend_attention  # noqa: E402
from radixlm.kernels.triton_ops import fused_moe, tile_plan  # noqa: E402
from radixlm.kernels.triton_ops import kv_store as triton_kv_store  # noqa: E402
from radixlm.kernels.triton_ops import mla_decode as triton_mla_decode  # noqa: E402

TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
         torch.int64: "i64", torch.int32: "i32"}
LAUNCH_OPTIONS = ("num_stages", "num_warps")
SHAPES = ("default", "llama", "mla", "moe")
LAUNCHES: list[tuple[triton.JITFunction, tuple, dict, tile_plan.Tiles | None]] = []
PLANS: list[tile_plan.Tiles] = []
i64 = torch.int64


class Recorder:
    """Stands in for a kernel's launch; records its arguments and the tiles planned for it."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            LAUNCHES.append((self.kernel, args, kwargs, PLANS.pop() if PLANS else None))
        return launch


def recording(plan):
    def planned(*args, **kwargs):
        tiles = plan(*args, **kwargs)
        PLANS.append(tiles)
        return tiles
    return planned


def unplanned_extend(head_dim_k, head_dim_v, dtype, shared_limit, block_m=64, block_n=64):
    tiles = PLANNERS[0](head_dim_k, head_dim_v, dtype, None, block_m, block_n)
    return tile_plan.Tiles(tiles.block_m, tiles.block_n, None, None)


def unplanned_mla(latent_dim, rope_dim, dtype, shared_limit, block_h=16, block_n=64):
    return tile_plan.Tiles(block_h, block_n, None, None)


PLANNERS = (tile_plan.extend_tiles, tile_plan.mla_decode_tiles)


def install(limit: int, planned: bool) -> None:
    """Recorders for every kernel; the target's shared memory for every wrapper."""
    for module, names in [
        (triton_kv_store, ["_store_kv_kernel"]),
        (triton_extend_attention, ["_extend_attention_kernel"]),
        (triton_decode_attention, ["_decode_split_kernel", "_merge_splits_kernel"]),
        (triton_mla_decode, ["_mla_decode_split_kernel"]),
        (fused_moe, ["_gate_up_silu_kernel", "_down_weighted_kernel"]),
    ]:
        for name in names:
            kernel = getattr(module, name)
            if not isinstance(kernel, Recorder):
                setattr(module, name, Recorder(kernel))
    tile_plan.shared_memory_per_block = lambda device: limit
    extend, mla = PLANNERS if planned else (unplanned_extend, unplanned_mla)
    tile_plan.extend_tiles = recording(extend)
    tile_plan.mla_decode_tiles = recording(mla)


def attention_launches(dtype, heads: int, kv_heads: int, head_dim: int, **layer) -> None:
    """store_kv, extend and decode over one layer's pool, as the Triton backend calls them."""
    pool_k = torch.zeros(64, kv_heads, head_dim, dtype=dtype)
    pool_v = torch.zeros(64, kv_heads, head_dim, dtype=dtype)
    table = torch.zeros(4, 32, dtype=i64)
    idx, lens = torch.zeros(2, dtype=i64), torch.ones(2, dtype=i64)
    q = torch.zeros(6, heads, head_dim, dtype=dtype)
    kv = torch.zeros(6, kv_heads, head_dim, dtype=dtype)
    slot_map = torch.zeros(64, dtype=i64) if layer.pop("slot_map", False) else None
    if slot_map is None:
        triton_kv_store.store_kv(kv, kv, pool_k, pool_v, torch.zeros(6, dtype=i64))
    triton_extend_attention.extend_attention(
        q, kv, kv, torch.empty_like(q), pool_k, pool_v, table, idx, idx, lens * 3, idx,
        3, 0.1, block_m=64, block_n=64, slot_map=slot_map, **layer,
    )
    triton_decode_attention.decode_attention(
        q[:2], torch.empty_like(q[:2]), pool_k, pool_v, table, idx, lens, 0.1,
        block_n=64, slot_map=slot_map, **layer,
    )


def mla_launches(dtype) -> list[str]:
    """DeepSeek-V2's latent attention: decode and extend (prefill) over a 512 + 64 row."""
    heads, latent, rope = 16, 512, 64
    pool = torch.zeros(64, 1, latent + rope, dtype=dtype)
    table = torch.zeros(4, 32, dtype=i64)
    idx, lens = torch.zeros(2, dtype=i64), torch.ones(2, dtype=i64)
    triton_mla_decode.mla_decode_attention(
        torch.zeros(2, heads, latent + rope, dtype=dtype),
        torch.empty(2, heads, latent, dtype=dtype), pool, latent, table, idx, lens, 0.1,
        block_n=64,
    )
    q = torch.zeros(6, heads, latent + rope, dtype=dtype)
    k = torch.zeros(6, 1, latent + rope, dtype=dtype)
    try:
        triton_extend_attention.extend_attention(
            q, k, k[..., :latent], torch.empty(6, heads, latent, dtype=dtype), pool,
            pool[..., :latent], table, idx, idx, lens * 3, idx, 3, 0.1, block_m=64, block_n=64,
        )
    except ValueError as err:
        return [f"_extend_attention_kernel (MLA) {dtype}: {err}"]
    return []


def moe_launches(dtype) -> None:
    fused_moe.fused_experts(
        torch.zeros(5, 256, dtype=dtype), torch.zeros(8, 512, 256, dtype=dtype),
        torch.zeros(8, 256, 256, dtype=dtype), torch.ones(5, 2),
        torch.zeros(5, 2, dtype=i64), block_m=64, block_n=64, block_k=32,
    )


def record_launches(dtype, shapes: list[str]) -> list[str]:
    """Runs the wrappers for ``shapes``; returns the launches they refused."""
    refused = []
    if "default" in shapes:  # SmolLM2-135M, and its heads with every layer feature
        attention_launches(dtype, 9, 3, 64)
        attention_launches(dtype, 9, 3, 64, sliding_window=16, logit_softcap=30.0,
                           slot_map=True)
    if "llama" in shapes:
        attention_launches(dtype, 32, 8, 128)
    if "mla" in shapes:
        refused += mla_launches(dtype)
    if "moe" in shapes:
        moe_launches(dtype)
    return refused


def compile_launch(kernel, args, kwargs, target: GPUTarget) -> int:
    """Compiles one launch for ``target``; returns the shared memory (bytes) it needs."""
    values = dict(zip(kernel.arg_names, args))
    values.update(kwargs)
    signature, constexprs = {}, {}
    for i, param in enumerate(kernel.params):
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[(i,)] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + TYPES[value.dtype]
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            signature[param.name] = "i32" if abs(value) < 2**31 else "i64"
    options = {k: kwargs[k] for k in LAUNCH_OPTIONS if k in kwargs}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs),
                              target=target, options=options)
    return compiled.metadata.shared


def check_target(arch: int, dtypes: list[torch.dtype], shapes: list[str]) -> int:
    """Compiles every recorded launch for sm_``arch``; returns the number of failures."""
    limit = tile_plan.SHARED_MEMORY_PER_BLOCK[arch]
    target = GPUTarget("cuda", arch, 32)
    failures = 0
    for dtype in dtypes:
        LAUNCHES.clear()
        for refusal in record_launches(dtype, shapes):
            allowed = dtype == torch.float32
            failures += not allowed
            print(f"{'refused' if allowed else 'FAILED refused'} sm_{arch} {refusal}")
        for kernel, args, kwargs, tiles in LAUNCHES:
            name = kernel.__name__
            kinds = sorted({str(a.dtype) for a in args if isinstance(a, torch.Tensor)})
            plan = "" if tiles is None else (
                f", tiles {tiles.block_m}x{tiles.block_n} stages {tiles.num_stages}, "
                f"estimate {tiles.shared_bytes}")
            try:
                shared = compile_launch(kernel, args, kwargs, target)
            except Exception as err:  # report every kernel, then fail
                failures += 1
                print(f"FAILED {name} {kinds} sm_{arch}: {type(err).__name__}: {err}")
                continue
            print(f"compiled {name} {kinds} sm_{arch}: {shared} bytes of shared memory "
                  f"(limit {limit}{plan})")
            if shared > limit:
                failures += 1
                print(f"FAILED {name} sm_{arch}: {shared} bytes, more shared memory than "
                      f"the {limit} sm_{arch} gives a block")
            if tiles is not None and tiles.shared_bytes is not None \
                    and shared > tiles.shared_bytes:
                failures += 1
                print(f"FAILED {name} sm_{arch}: {shared} bytes, more than tile_plan's "
                      f"estimate {tiles.shared_bytes}: the estimate no longer bounds Triton")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dtypes", nargs="*", default=["bfloat16"])
    parser.add_argument("--arch", default="90",
                        help="compute capabilities, comma-separated: 80,86,89,90")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    parser.add_argument("--unplanned", action="store_true",
                        help="launch at the tiles asked for, ignoring shared memory")
    args = parser.parse_args(argv)
    dtypes = [getattr(torch, name) for name in args.dtypes]
    archs = [int(arch) for arch in args.arch.split(",")]
    known = sorted(tile_plan.SHARED_MEMORY_PER_BLOCK)
    if set(archs) - set(known):
        parser.error(f"--arch {args.arch}: each must be one of {known}")
    failures = 0
    for arch in archs:
        install(tile_plan.SHARED_MEMORY_PER_BLOCK[arch], planned=not args.unplanned)
        failures += check_target(arch, dtypes, args.shapes)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
