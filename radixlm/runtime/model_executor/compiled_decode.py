"""torch.compile of the model's decode forward on CPUs (``--enable-torch-compile``).

The compiled function is the model's own forward, traced whole into one graph in which the
work the fused CPU kernels do fastest stays theirs, as opaque operators
(``models/layers/compiled_ops.py``): each projection through its packed weight, or the
kernels' matmul of a plain one, and each layer's attention over the paged pool (whose
per-batch metadata, built on the host from Python lists, stays outside the graph). What lies
between them, the norms with their residual adds, RoPE, SiLU-and-multiply, some ten small
torch operations a layer, inductor fuses into generated C++ loops. An eager decode step
runs those as the fused decode layer's one call (``cpu_decode_layer.py``) instead.

Shapes: a pass of one request compiles with its sizes fixed; the first pass of more marks
the batch dimension dynamic, and that graph serves every batch size from 2 to
``max_batch_size``. Both are compiled at start (``warm_up``), on a batch of padding rows
(row 0 of ``req_to_token``, KV written into slot 0, the allocator's reserved padding page),
so no request waits for a compile.

MoE models decode eagerly: their experts group tokens by the router's choices on the host,
which would split the graph there and compile anew for each routing pattern mid-serve.

After the warm-up a compiled pass may not compile again (``fail_on_recompile``): a pass that
would (a guard the warm-up did not foresee) raises before any operator runs, and the
``ModelRunner`` then decodes eagerly from that step on, after one warning.

Threads: inductor's loops are generated for the thread count of the compiling pass (a
different count is a recompile), so compiled passes run at one fixed count.

Compiled artefacts are cached on disk by inductor (``TORCHINDUCTOR_CACHE_DIR``, which
defaults here to ``$RADIXLM_CACHE/inductor``): a second start with the same model, dtype,
thread count, torch and CPU reuses them. Where no C++ compiler is found, or the warm-up's
compile fails, one warning says why and decode runs eagerly.

Invariants: only DECODE batches of at most ``max_batch_size`` requests run compiled; the
result equals the eager forward's up to float rounding of fused operations (float32:
within 1e-5).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable

import torch

from radixlm.kernels.forward_batch import ForwardBatch, ForwardMode
from radixlm.models.default_model import radixlm_cache_dir
from radixlm.models.layers.attention import PagedAttention
from radixlm.models.layers.compiled_ops import compiled_pass
from radixlm.models.layers.linear import Linear
from radixlm.models.layers.moe_experts import StackedExperts

logger = logging.getLogger(__name__)

PaddingBatchFactory = Callable[[int], ForwardBatch]
"""batch size -> a decode batch whose every row is padding (see the module docstring)."""


def use_inductor_cache_dir() -> str:
    """Points inductor's on-disk cache at ``$RADIXLM_CACHE/inductor`` unless
    ``TORCHINDUCTOR_CACHE_DIR`` says otherwise; returns the directory."""
    if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(radixlm_cache_dir() / "inductor")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def missing_compiler() -> str | None:
    """Why inductor cannot build C++ here (no compiler where it looks), or None."""
    from torch._inductor import cpp_builder  # (imports inductor: only when compiling)

    try:
        compiler = cpp_builder.get_cpp_compiler()
    except Exception as err:  # noqa: BLE001 - whatever inductor's lookup raises is the reason
        return f"no C++ compiler for inductor ({err})"
    if shutil.which(compiler) is None:
        return f"inductor's C++ compiler {compiler!r} is not installed"
    return None


class CompiledDecodeRunner:
    """The decode forward of ``model`` compiled by inductor, for batches of up to
    ``max_batch_size`` requests, run at ``threads`` CPU threads.

    ``padding_batch`` builds the warm-up's batches; ``set_threads`` sets the calling
    thread's CPU thread count. Construction compiles (``warm_up``) and raises whatever the
    compile raises: ``ModelRunner`` falls back to eager decode then.
    """

    def __init__(self, model: torch.nn.Module, *, max_batch_size: int, threads: int,
                 padding_batch: PaddingBatchFactory,
                 set_threads: Callable[[int], None]):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self.threads = threads
        self._set_threads = set_threads
        self._layers = {m.layer_id: m for m in model.modules() if isinstance(m, PagedAttention)}
        self._packed_weights = {m.packed_key: m.packed for m in model.modules()
                                if isinstance(m, Linear) and m.packed is not None}
        self._compiled = torch.compile(model.forward, backend="inductor")
        self._stance = "default"
        self.warm_up(padding_batch)
        self._stance = "fail_on_recompile"

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        return (forward_batch.mode is ForwardMode.DECODE
                and forward_batch.batch_size <= self.max_batch_size)

    def run(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """The decode step's hidden states (B, hidden); the backend's metadata for the batch
        is already built (``init_forward_metadata``)."""
        self._set_threads(self.threads)
        fb = forward_batch
        with (torch.inference_mode(), torch.compiler.set_stance(self._stance),
              compiled_pass(fb, self._layers, self._packed_weights)):
            return self._compiled(fb.input_ids, fb.positions, fb)

    def warm_up(self, padding_batch: PaddingBatchFactory) -> None:
        """Compiles the one-request graph and the dynamic one (see the module docstring),
        which the largest batch then runs."""
        for size in dict.fromkeys((1, min(2, self.max_batch_size), self.max_batch_size)):
            batch = padding_batch(size)
            batch.attn_backend.init_forward_metadata(batch)
            self.run(batch)
        logger.info("decode compiled by torch.compile (inductor) for batches of 1-%d "
                    "requests; cache: %s", self.max_batch_size,
                    os.environ.get("TORCHINDUCTOR_CACHE_DIR"))


def compile_decode(model: torch.nn.Module, device: torch.device, **options
                   ) -> CompiledDecodeRunner | None:
    """A ``CompiledDecodeRunner(model, **options)`` where it can run: on a CPU (GPU decode
    replays CUDA graphs instead), a model without MoE experts, a C++ compiler, and its
    warm-up compiled; else None, after one warning saying why decode runs eagerly."""
    reason = None if device.type == "cpu" else f"it compiles CPU decode, not {device.type}"
    if reason is None and any(isinstance(m, StackedExperts) for m in model.modules()):
        reason = "MoE experts group tokens on the host (a compile per routing pattern)"
    reason = reason or missing_compiler()
    if reason is None:
        use_inductor_cache_dir()
        try:
            return CompiledDecodeRunner(model, **options)
        except Exception as err:  # noqa: BLE001 - any compile failure: decode eagerly
            torch._dynamo.reset()
            reason = f"compiling failed ({type(err).__name__}: {err})"
    logger.warning("enable_torch_compile: decode runs eagerly: %s", reason)
    return None
