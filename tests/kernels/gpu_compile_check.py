"""Compiles every radixlm Triton kernel for an NVIDIA Hopper GPU (sm_90), without a GPU.

The interpreter runs kernels as numpy and misses what only the compiler checks (types of
loop-carried values, tensor-core tile minimums, constexpr use). This script runs each
kernel's Python wrapper on small CPU tensors with the kernels' launch replaced by a
recorder, then compiles every recorded launch, with its real arguments' types, to a cubin
through Triton's own compiler (``triton.compile`` with an explicit target). Run it with
TRITON_INTERPRET unset, and the dtypes to check as arguments (default: bfloat16); prints
one line per compiled kernel and exits 1 on any failure.
"""

from __future__ import annotations

import os
import sys

import torch

assert not os.environ.get("TRITON_INTERPRET"), "compile checks need the real Triton compiler"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from radixlm.kernels.triton_ops import decode_attention as triton_decode_attention  # noqa: E402
from radixlm.kernels.triton_ops import extend_attention as triton_extend_attention  # noqa: E402
from radixlm.kernels.triton_ops import fused_moe  # noqa: E402
from radixlm.kernels.triton_ops import kv_store as triton_kv_store  # noqa: E402
from radixlm.kernels.triton_ops import mla_decode as triton_mla_decode  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
MAX_SHARED_BYTES = 227 * 1024  # what one Hopper block may use
TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
         torch.int64: "i64", torch.int32: "i32"}
LAUNCHES: list[tuple[triton.JITFunction, tuple, dict]] = []


class Recorder:
    """Stands in for a kernel's launch; records its arguments."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            LAUNCHES.append((self.kernel, args, kwargs))
        return launch


def record(module, name):
    setattr(module, name, Recorder(getattr(module, name)))


def compile_launch(kernel, args, kwargs) -> int:
    """Compiles one launch for sm_90; returns the shared memory (bytes) it needs."""
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
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=TARGET)
    return compiled.metadata.shared


def main(dtype_names: list[str]) -> int:
    for module, names in [
        (triton_kv_store, ["_store_kv_kernel"]),
        (triton_extend_attention, ["_extend_attention_kernel"]),
        (triton_decode_attention, ["_decode_split_kernel", "_merge_splits_kernel"]),
        (triton_mla_decode, ["_mla_decode_split_kernel"]),
        (fused_moe, ["_gate_up_silu_kernel", "_down_weighted_kernel"]),
    ]:
        for name in names:
            record(module, name)
    i64 = torch.int64
    for dtype in [getattr(torch, name) for name in dtype_names]:
        pool_k = torch.zeros(64, 2, 128, dtype=dtype)
        pool_v = torch.zeros(64, 2, 128, dtype=dtype)
        table = torch.zeros(4, 32, dtype=i64)
        idx = torch.zeros(2, dtype=i64)
        lens = torch.ones(2, dtype=i64)
        q = torch.zeros(6, 8, 128, dtype=dtype)
        kv = torch.zeros(6, 2, 128, dtype=dtype)
        triton_kv_store.store_kv(kv, kv, pool_k, pool_v, torch.zeros(6, dtype=i64))
        triton_extend_attention.extend_attention(
            q, kv, kv, torch.empty_like(q), pool_k, pool_v, table, idx, idx, lens * 3, idx,
            3, 0.1, block_m=64, block_n=64,
        )
        triton_decode_attention.decode_attention(
            q[:2], torch.empty_like(q[:2]), pool_k, pool_v, table, idx, lens, 0.1,
            block_n=64,
        )
        latent = torch.zeros(64, 1, 576, dtype=dtype)
        triton_mla_decode.mla_decode_attention(
            torch.zeros(2, 16, 576, dtype=dtype), torch.empty(2, 16, 512, dtype=dtype),
            latent, 512, table, idx, lens, 0.1, block_n=64,
        )
        if dtype.itemsize == 2:  # MLA prefill at the GPU's tiles (16-bit only, see there)
            mla_q = torch.zeros(6, 16, 576, dtype=dtype)
            mla_k = torch.zeros(6, 1, 576, dtype=dtype)
            triton_extend_attention.extend_attention(
                mla_q, mla_k, mla_k[..., :512], torch.empty(6, 16, 512, dtype=dtype), latent,
                latent[..., :512], table, idx, idx, lens * 3, idx, 3, 0.1, block_m=64,
                block_n=64,
            )
        fused_moe.fused_experts(
            torch.zeros(5, 256, dtype=dtype, device="cpu"), torch.zeros(8, 512, 256, dtype=dtype),
            torch.zeros(8, 256, 256, dtype=dtype), torch.ones(5, 2),
            torch.zeros(5, 2, dtype=i64), block_m=64, block_n=64, block_k=32,
        )
    failures = 0
    for kernel, args, kwargs in LAUNCHES:
        dtypes = sorted({str(a.dtype) for a in args if isinstance(a, torch.Tensor)})
        try:
            shared = compile_launch(kernel, args, kwargs)
            print(f"compiled {kernel.__name__} {dtypes}: {shared} bytes of shared memory")
            if shared > MAX_SHARED_BYTES:
                failures += 1
                print(f"FAILED {kernel.__name__}: needs more shared memory than sm_90 has")
        except Exception as err:  # report every kernel, then fail
            failures += 1
            print(f"FAILED {kernel.__name__} {dtypes}: {type(err).__name__}: {err}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["bfloat16"]))
