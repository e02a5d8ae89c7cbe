"""The MoE layer (grouped per-expert matmuls) against a naive loop over tokens and experts.

One ``MoEBlock`` of a Mixtral-like shape scaled down (hidden 1024, 8 experts, top-2,
expert intermediate 2816), random weights, run on T random tokens for T in 1, 16, 256:
once with the grouped torch computation (tokens sorted by expert, one matmul per active
expert), once with ``naive_experts_per_token`` (for each token, for each of its k experts,
a matrix-vector product). Both use the same router; outputs are checked equal first.
Tokens/s is T over the median wall time of one forward; the ratio is grouped / naive,
from the same run. In bfloat16 on a CPU with oneDNN's bfloat16 matmul, the grouped
computation also runs on the experts laid out as the loader lays them out
(``cpu_weight_layout.py``), reported as "laid out" with its ratio to the grouped one.

    python benchmarks/bench_moe.py [--dtype float32] [--min-seconds 1.0] [--threads N]

On a shared, oversubscribed CPU, multi-threaded GEMMs with few rows stall on OpenMP
barriers (tens of ms each); ``--threads 1`` measures the algorithms without that noise.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from radixlm.kernels.cpu_ops.execution_plan import CpuExecutionPlan  # noqa: E402
from radixlm.models.layers.cpu_weight_layout import (  # noqa: E402
    BlockedWeight,
    uses_blocked_layout,
)
from radixlm.models.layers.moe import MoEBlock  # noqa: E402
from radixlm.models.layers.moe_experts import (  # noqa: E402
    grouped_experts_torch,
    naive_experts_per_token,
)
from radixlm.models.layers.moe_router import RouterConfig  # noqa: E402

HIDDEN, EXPERTS, TOP_K, INTERMEDIATE = 1024, 8, 2, 2816
BATCHES = (1, 16, 256)


def build_block(dtype: torch.dtype) -> MoEBlock:
    torch.manual_seed(0)
    router = RouterConfig(num_experts=EXPERTS, top_k=TOP_K, renormalize=True)
    block = MoEBlock(HIDDEN, INTERMEDIATE, router)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.02)
            if not getattr(param, "keep_float32", False):  # as the loader casts (the router's
                param.data = param.data.to(dtype)          # weight stays float32)
    return block.train(False).requires_grad_(False)


def seconds_per_forward(block: MoEBlock, x: torch.Tensor, min_seconds: float) -> float:
    """Median wall time of one forward, over as many runs as fit in ``min_seconds`` (>= 3)."""
    block(x)  # warm-up
    times: list[float] = []
    while len(times) < 3 or sum(times) < min_seconds:
        start = time.perf_counter()
        block(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--min-seconds", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    block = build_block(dtype)
    laid_out = None
    if uses_blocked_layout(torch.device("cpu"), dtype):
        laid_out = build_block(dtype)
        laid_out.experts.pack_expert_weights(
            functools.partial(BlockedWeight.pack, plan=CpuExecutionPlan()))
    print(f"MoE block: hidden {HIDDEN}, {EXPERTS} experts, top-{TOP_K}, intermediate "
          f"{INTERMEDIATE}, {args.dtype}, {torch.get_num_threads()} threads")
    extra = f" {'laid out tok/s':>15} {'laid/grouped':>13}" if laid_out else ""
    print(f"{'tokens':>6} {'grouped tok/s':>14} {'naive tok/s':>12} {'grouped/naive':>14}{extra}")
    for tokens in BATCHES:
        x = torch.randn(tokens, HIDDEN, dtype=dtype)
        block.experts.computation = grouped_experts_torch
        grouped_out = block(x)
        grouped = seconds_per_forward(block, x, args.min_seconds)
        block.experts.computation = naive_experts_per_token
        naive_out = block(x)
        naive = seconds_per_forward(block, x, args.min_seconds)
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(grouped_out, naive_out, atol=tol, rtol=tol)
        line = (f"{tokens:>6} {tokens / grouped:>14.1f} {tokens / naive:>12.1f} "
                f"{naive / grouped:>13.2f}x")
        if laid_out is not None:
            torch.testing.assert_close(laid_out(x), grouped_out, atol=tol, rtol=tol)
            seconds = seconds_per_forward(laid_out, x, args.min_seconds)
            line += f" {tokens / seconds:>15.1f} {grouped / seconds:>12.2f}x"
        print(line)


if __name__ == "__main__":
    main()
