"""GGUF block weights on the CPU: ``quantized_matmul`` (blocks decoded in L1 as the pass
reads them) against decoding the weight into a reused buffer (``dequantize_blocks``) and
torch's GEMM, side by side for passes of T rows; where they cross is
``gguf_weight.KERNEL_MAX_ROWS_*``.

    PYTHONPATH=. python benchmarks/bench_gguf_matmul.py [--rows 1 4 16 64 512] [--repeats 5]

Prints a markdown table (median milliseconds per pass) for projection-sized weights in
Q4_K, Q6_K, Q5_0 and Q8_0 and a vocabulary head in Q8_0, float32 and bfloat16 activations
(``--dtypes`` to choose). With
``--one-row-types``: instead, one bfloat16 row against every served type on 2048 x 1024 and
8192 x 2048 weights (out x in) and the Q8_0 head, in ms and GB/s of blocks (a decode step's
products).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from machine import describe_machine

from radixlm.kernels.cpu_ops import fused_ops
from radixlm.kernels.quantized.block_formats import NATIVE_TYPES, QType, row_bytes

MATRICES = [("projection 640x2048", QType.Q4_K, 640, 2048),
            ("projection 640x2048", QType.Q6_K, 640, 2048),
            ("projection 2048x640", QType.Q5_0, 2048, 640),
            ("projection 640x2048", QType.Q8_0, 640, 2048),
            ("vocabulary head 262144x640", QType.Q8_0, 262144, 640)]
SCALES = {QType.Q4_K: (0, 2), QType.Q6_K: (208,), QType.Q5_0: (0,), QType.Q8_0: (0,)}
"""Where each block of these types keeps its float16 scales."""


def random_blocks(qtype: QType, out_features: int, in_features: int) -> torch.Tensor:
    """Random bytes with every block's float16 scales set small (timing does not depend
    on the values, only on their being finite)."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (out_features, row_bytes(qtype, in_features)),
                          dtype=np.uint8)
    per_block = blocks.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])
    for at in SCALES[qtype]:
        per_block[:, at:at + 2] = np.full((1, 1), 0.01, dtype=np.float16).view(np.uint8)
    return torch.from_numpy(blocks)


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def widened(kernels, x, blocks, qtype, buffer):
    """The long-pass path: the blocks decoded into ``buffer``, then torch's GEMM."""
    kernels.dequantize_blocks(blocks, int(qtype), buffer)
    return F.linear(x, buffer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 512])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--one-row-types", action="store_true")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    if not fused_ops.enable():
        raise SystemExit(f"the fused CPU kernels are unavailable: "
                         f"{fused_ops.unavailable_reason()}")
    kernels = fused_ops.active()
    print(describe_machine())
    if args.one_row_types:
        return one_row_types(kernels, args.repeats)
    print("| weight | type | x dtype | T | kernel ms | decode + GEMM ms | of which decode |")
    print("|---|---|---|---|---|---|---|")
    for name, qtype, out_features, in_features in MATRICES:
        blocks = random_blocks(qtype, out_features, in_features)
        for dtype in (getattr(torch, name) for name in args.dtypes):
            buffer = torch.empty(out_features, in_features, dtype=dtype)
            decode = median_ms(partial(kernels.dequantize_blocks, blocks, int(qtype), buffer),
                               args.repeats)
            for rows in args.rows:
                x = torch.randn(rows, in_features).to(dtype)
                repeats = args.repeats if rows * out_features < 2**24 else 2
                kernel = median_ms(partial(kernels.quantized_matmul, x, blocks, int(qtype)),
                                   repeats)
                gemm = median_ms(partial(widened, kernels, x, blocks, qtype, buffer), repeats)
                print(f"| {name} | {qtype.name} | {str(dtype).removeprefix('torch.')} | "
                      f"{rows} | {kernel:.2f} | {gemm:.2f} | {decode:.2f} |", flush=True)


def one_row_types(kernels, repeats: int) -> None:
    """One bfloat16 row against each served type's blocks (tests/quantized_cases.py's:
    finite scales)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from quantized_cases import random_blocks as quantized_blocks

    print("| weight (out x in) | type | kernel ms | GB/s of blocks |")
    print("|---|---|---|---|")
    shapes = [(2048, 1024, sorted(NATIVE_TYPES)), (8192, 2048, sorted(NATIVE_TYPES)),
              (262144, 640, [QType.Q8_0])]
    for out_features, in_features, qtypes in shapes:
        for qtype in qtypes:
            values = gguf.GGML_QUANT_SIZES[qtype][0]
            blocks = torch.from_numpy(
                quantized_blocks(qtype, out_features, in_features // values, seed=1))
            x = torch.randn(1, in_features).to(torch.bfloat16)
            ms = median_ms(lambda x=x, blocks=blocks, qtype=qtype:
                           kernels.quantized_matmul(x, blocks, int(qtype)),
                           max(repeats, 40 if out_features < 10000 else 8))
            print(f"| {out_features}x{in_features} | {qtype.name} | {ms:.3f} | "
                  f"{blocks.numel() / ms / 1e6:.1f} |", flush=True)


if __name__ == "__main__":
    main()
