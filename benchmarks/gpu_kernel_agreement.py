"""The GPU kernels against torch references at real shapes, in bfloat16 and float32.

Part of ``benchmarks/gpu_check.sh`` (issue 58). Each case runs one kernel path on the GPU
and the torch-native computation of the same thing, and prints one line: the case, the
dtype, the largest absolute difference, the tolerance and ``ok`` / ``FAIL``, or ``ERROR``
with the exception where it raises. One refusal is expected and is not an error: float32
MLA extend on a GPU whose shared memory fits no tile of it (sm_86, sm_89), where
``tile_plan.extend_tiles`` raises a ValueError saying how many bytes of shared memory it
needs; that case prints ``refused`` with the message. Any other exception, a ValueError
included, is an ``ERROR``.

- decode / extend: ``TritonAttentionBackend`` (and ``FlashInferAttentionBackend`` where
  ``flashinfer`` imports, in 16-bit dtypes and its head sizes) against
  ``TorchNativeAttentionBackend`` over the kernel tests' random paged batches
  (``tests/kernels/paged_cases.py``) at the default model's heads (9 over 3 of 64) and
  Llama-8B's (32 over 8 of 128), contexts up to 4,096, pages of 1 and 16;
- MLA: the Triton decode and extend kernels over a latent pool at DeepSeek-V2's shapes
  (16 heads, a 512 + 64 row) against the torch-native backend;
- fused MoE: ``fused_experts`` against ``grouped_experts_torch`` at DeepSeek-V2-Lite's
  shapes (64 experts, top 6, hidden 2,048, intermediate 1,408).

    python benchmarks/gpu_kernel_agreement.py        # CUDA only; exits 2 without it

Exits 1 when any case fails or errors (the refusal above is not a failure).
``gpu_check.sh`` gives it a time limit, which Triton compiling the kernels on first use
takes most of: a budget, not a measurement; the first GPU run calibrates it.
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "kernels"), str(ROOT / "tests")]

from paged_cases import (  # noqa: E402
    random_latent_pool,
    random_paged_batch,
    torch_native_reference,
)

from radixlm.kernels.attention.triton_backend import (  # noqa: E402
    TritonAttentionBackend,
    TritonBackendConfig,
)
from radixlm.kernels.forward_batch import ForwardMode  # noqa: E402
from radixlm.kernels.triton_ops.fused_moe import fused_experts  # noqa: E402
from radixlm.models.layers.attention import PagedAttention  # noqa: E402
from radixlm.models.layers.moe_experts import grouped_experts_torch  # noqa: E402

DEVICE = torch.device("cuda")
DTYPES = (torch.bfloat16, torch.float32)
# Largest |kernel - reference| allowed, per dtype, for outputs of magnitude ~1.
TOLERANCE = {torch.bfloat16: 3e-2, torch.float32: 2e-3}
HEADS = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}
LENGTHS = {  # mode: (prefix lengths, extend lengths)
    ForwardMode.DECODE: ([4095, 1000, 17, 0, 2048, 300, 64, 1], [1] * 8),
    ForwardMode.EXTEND: ([0, 1500, 17, 512], [700, 300, 64, 1]),
}
MAX_CONTEXT = 4096
# The one refusal allowed: tile_plan.extend_tiles on a GPU too small for the case's tiles.
SHARED_MEMORY_REFUSAL = "bytes of shared memory"


class Report:
    """The lines printed and whether any case failed."""

    def __init__(self) -> None:
        self.failed = 0

    def case(self, name: str, dtype: torch.dtype, run: Callable[[], float],
             may_refuse: bool = False) -> None:
        """Runs one case. ``may_refuse``: a ValueError naming the shared memory the kernel
        needs is a refusal (printed, not counted), not an error."""
        label = f"{name} {str(dtype).removeprefix('torch.')}"
        try:
            diff = run()
        except Exception as err:
            if (may_refuse and isinstance(err, ValueError)
                    and SHARED_MEMORY_REFUSAL in str(err)):
                print(f"refused {label}: {err}", flush=True)
                return
            self.failed += 1
            print(f"ERROR   {label}: {type(err).__name__}: {err}", flush=True)
            traceback.print_exc(limit=4, file=sys.stdout)
            return
        ok = diff <= TOLERANCE[dtype]
        self.failed += not ok
        print(f"{'ok     ' if ok else 'FAIL   '} {label}: max abs diff {diff:.2e} "
              f"(tolerance {TOLERANCE[dtype]:.0e})", flush=True)


def max_diff(out: torch.Tensor, expected: torch.Tensor) -> float:
    """Waits for the kernels (errors surface here) and compares."""
    if out.device.type == "cuda":
        torch.cuda.synchronize()
    return float((out.float() - expected.float()).abs().max())


def attention_case(backend_factory, mode, heads, page_size, dtype, latent=None) -> float:
    """One layer through ``backend_factory()`` and through torch-native, on cloned pools."""
    num_heads, num_kv_heads, head_dim = heads
    prefix_lens, extend_lens = LENGTHS[mode]
    if latent is not None:
        head_dim = sum(latent)
    case = random_paged_batch(mode, prefix_lens, extend_lens, num_heads, num_kv_heads,
                              head_dim, page_size, seed=7, device=DEVICE, dtype=dtype,
                              max_context=MAX_CONTEXT)
    batch = case.batch
    v = case.v
    layer = PagedAttention(1, num_heads, num_kv_heads, head_dim, head_dim**-0.5)
    if latent is not None:  # MLA: one latent row per token, the values its first D_l
        batch.kv_pool = random_latent_pool(batch.kv_pool.num_slots, *latent, dtype, DEVICE,
                                           seed=8)
        v = case.k[..., : latent[0]]
        layer = PagedAttention(1, num_heads, 1, head_dim, head_dim**-0.5, v_head_dim=latent[0])
    expected, _ = torch_native_reference(case, v, layer)
    backend = backend_factory(heads if latent is None else (num_heads, 1, head_dim), page_size,
                              dtype)
    batch.attn_backend = backend
    backend.init_forward_metadata(batch)
    out = backend.forward(case.q, case.k, v, layer, batch)
    return max_diff(out, expected)


def triton_backend(heads, page_size, dtype):
    return TritonAttentionBackend(TritonBackendConfig.for_device(DEVICE), device="cuda")


def flashinfer_backend(heads, page_size, dtype):
    from radixlm.kernels.attention.flashinfer_backend import (
        AttentionShape,
        FlashInferAttentionBackend,
    )

    num_heads, num_kv_heads, head_dim = heads
    shape = AttentionShape(num_heads, num_kv_heads, head_dim, page_size, dtype, head_dim**-0.5)
    return FlashInferAttentionBackend(shape, DEVICE)


def moe_case(dtype) -> float:
    experts, top_k, hidden, inter, tokens = 64, 6, 2048, 1408, 256
    gen = torch.Generator().manual_seed(3)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5)
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = torch.softmax(torch.rand(tokens, experts, generator=gen), -1).topk(top_k, -1)
    args = [t.to(DEVICE) for t in (x, w13, w2)]
    args = [t.to(dtype) for t in args] + [weights.to(DEVICE), ids.to(DEVICE)]
    expected = grouped_experts_torch(*args)
    out = fused_experts(*args)
    return max_diff(out, expected)


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA: skipped")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 references in float32
    has_flashinfer = importlib.util.find_spec("flashinfer") is not None
    print(f"device {torch.cuda.get_device_name()}; flashinfer "
          f"{'imports' if has_flashinfer else 'absent: its cases are left out'}", flush=True)
    report = Report()
    for dtype in DTYPES:
        for mode in LENGTHS:
            for name, heads in HEADS.items():
                for page_size in (1, 16):
                    label = f"{mode.name.lower()} {name} page{page_size}"
                    report.case(f"triton {label}", dtype, lambda m=mode, h=heads, p=page_size,
                                d=dtype: attention_case(triton_backend, m, h, p, d))
                    if has_flashinfer and dtype != torch.float32:
                        report.case(f"flashinfer {label}", dtype,
                                    lambda m=mode, h=heads, p=page_size, d=dtype:
                                    attention_case(flashinfer_backend, m, h, p, d))
            report.case(f"triton mla {mode.name.lower()} deepseek-v2", dtype,
                        lambda m=mode, d=dtype: attention_case(
                            triton_backend, m, (16, 1, 576), 16, d, latent=(512, 64)),
                        may_refuse=mode is ForwardMode.EXTEND and dtype == torch.float32)
        report.case("fused_moe deepseek-v2-lite", dtype, lambda d=dtype: moe_case(d))
    print(f"{report.failed} case(s) failed", flush=True)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
