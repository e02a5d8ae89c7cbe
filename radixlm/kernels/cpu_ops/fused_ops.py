"""Fused CPU kernels for the small operations between a forward pass's matmuls.

On a CPU the operations between the matmuls cost their dispatch, not their arithmetic: on
the default model (batch-1 decode, bfloat16, a 2-core AMX CPU) a step's some 1,000 torch
operations took half as long again as its matmuls, and each RMSNorm is a chain of ten
operations inside ``F.rms_norm`` (figures in benchmarks/RESULTS.md). The kernels of
``fused_ops.cpp`` each do one such chain in one call:

- ``rms_norm(x, weight, eps)`` and ``add_rms_norm(x, residual, weight, eps)`` (the residual
  add of pre-norm decoders folded in: returns the norm and the sum);
- ``paged_decode_attention(q, k_buffer, v_buffer, slots, seq_lens, scale, softcap=0)`` (in
  ``decode_attention.cpp``): one query per request over its keys where they lie in the pool,
  instead of gathering them into a padded batch for ``scaled_dot_product_attention`` (on
  AVX-512, keys scored 16 at a time; on AVX2, 8 at a time); ``softcap`` > 0 caps the scaled
  scores (Gemma 2), and a sliding window is a table of the window's keys alone;
- ``rotary(x, cos, signed_sin)``: RoPE's roll, multiply and multiply-add;
- ``silu_mul(gate_up)``: the gated MLP's split, SiLU and product;
- ``scatter_rows(buffer, slots, rows)``: ``buffer.index_copy_(0, slots, rows)``, a KV pool's
  store, as row copies split between the threads (the runner hands it to the pool);
- ``paged_prefill_attention(q, k_buffer, v_buffer, slots, seq_lens, extend_lens, scale)``
  (in ``prefill_attention.cpp``): an extend batch's causal attention in one call, bfloat16
  on AVX-512 BF16 dot products, each sequence (fresh or after a cached prefix) over its
  keys where they lie in the KV pool, computing only the key blocks the mask keeps
  (torch's CPU flash kernel computes all of a block of up to 512); in float32
  (``prefill_attention_float32.cpp``) on float32 multiply-adds; ``causal_prefill_attention``
  says where it serves;
- ``int8_matmul(x, weight, scales)`` and ``dense_matmul(x, weight)`` (in
  ``few_rows_matmul.cpp``): the few rows of a decode step against a projection's weight
  stored as int8 or float16 (the weight-only formats, ``models/layers/weight_formats.py``),
  as bfloat16 or float16 under float32 activations (``dtype=auto`` on CPUs without native
  bfloat16, ``models/layers/weight_storage.py``, for weights whose rows are not a multiple
  of 16) or in x's dtype (bfloat16 rows kept beside oneDNN's layout,
  ``models/layers/cpu_weight_layout.py``), asking for the weights ahead of where they read;
- ``blocked_matmul(x, blocks)`` (in ``blocked_matmul.cpp``): float32 rows against a 16-bit
  weight in column blocks, ``dtype=auto``'s storage on CPUs without native bfloat16 (16
  outputs' weights of one input widened once for up to 6 rows);
  ``blocked_int8_matmul(x, blocks, scales)``: the same against int8 blocks, each output's
  sum times its scale (``int8wo`` served in float32);
- ``pair_matmul(x, pairs)`` (in ``pair_matmul.cpp``): bfloat16 rows against a weight laid
  out by column pairs (``models/layers/cpu_weight_layout.py``) on AVX-512 BF16 dot products,
  each row's products independent of the rows beside it;
  ``pair_kernels_pay`` says where it serves; ``int8_pair_matmul(x, pairs, scales)``, the
  same over int8 weights by pairs (``int8wo`` there), widened to bfloat16 in registers;
  ``pair_matmul_silu(x, pairs)`` and ``int8_pair_matmul_silu(x, pairs, scales)``, a gated
  MLP's gate and up products taken straight to silu(gate) * up (``silu_mul``'s bits);
- ``decode_layer(...)`` (in ``decode_layer.cpp``): a Llama-style layer's whole decode step
  (the norms, QKV, RoPE, KV store, attention, O and MLP) as one call of the kernels above,
  each projection multiplied as ``ProjectionKernel`` says (``models/layers/cpu_decode_layer.py``);
  ``decode_layers(...)``, every layer's in one call (``models/layers/cpu_decode_stack.py``);
  both add LoRA adapters' terms to the projections where a step has them;
  ``sandwich_decode_layers(...)`` (in ``sandwich_decode_layers.cpp``), the same for Gemma's
  sandwich layers (four norms, q/k norms, a RoPE table and attention table per layer, a
  GELU gate; ``models/layers/cpu_sandwich_decode.py``);
- ``lora_add(x, y, ...)`` (in ``lora_matmul.cpp``): every LoRA adapter's term of a pass added
  to a projection's output, each adapter's weights read once (``models/lora/lora_layers.py``);
- ``argmax_rows(x)`` (in ``argmax.cpp``): ``x.argmax(dim=-1)`` over float32 logits, the
  same answers (ties, NaN) from vector lanes instead of torch's one value at a time
  (greedy sampling, ``runtime/sampling/sampler.py``);
- ``quantized_matmul(x, blocks, type)``, ``quantized_matmul_parts(x, parts, types)`` (a
  weight stacked from parts of several types, one output) and ``dequantize_blocks(blocks,
  type, out)`` (in ``quantized_matmul.cpp``): rows against a GGUF block-quantized weight
  (llama.cpp's Q4_0 to Q8_K layouts, ``kernels/quantized/block_formats.py``,
  ``gguf_blocks.h``), a few weight rows' blocks decoded in registers against up to 4 rows of
  x at a time, float32 sums (in ``quantized_matmul_bf16.cpp``, bfloat16 rows on a build with
  AVX-512 BF16: each block's integers, unscaled, on bfloat16 dot products, its scales
  applied once to their sums; ``quantized_bf16_dots_serve(x, type)`` says where); and
  the weight decoded into a reused buffer for torch's GEMM (``models/layers/gguf_weight.py``
  picks between them by rows).

Each works a row at a time in whole SIMD vectors (16-bit rows converted in registers),
split between the threads by rows (the prefill attention: four query rows at a time, tasks
of 32 rows of a head). In a 512-token prefill on the AMX CPU they are a small share of the
pass beside the matmuls and torch's attention, half of it the MLP's SiLU-and-multiply, at
torch's own speed. Each kernel's figures against torch are in benchmarks/RESULTS.md.

They compute in float32 whatever the storage type and round intermediates to it where
torch's chains store them, so bfloat16 results equal torch's bit for bit except where a
float32 sum is ordered differently (the norms, attention: within one bfloat16 step), and
float32 results agree to float32 rounding (the tests hold them to both).

The kernels are compiled for the CPU that builds them, with torch's C++ extension builder (a
C++ compiler and ninja), once per machine. Each source compiles on its own: what they share
is in ``common.h`` (``matmul_lanes.h`` for the matmuls, ``prefill_attention.h`` for two files), the
entry points are declared in ``kernels.h`` and exposed to Python by ``bindings.cpp``, and the
constants Python shares with them (``ProjectionKernel``, ``PREFILL_MAX_VALUE_DIM``) are
defined here only and passed as ``-D`` flags. The build is cached in torch's extensions
directory (``$TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions``) under a name that
carries the CPU's instruction-set flags and the torch and Python versions; ninja recompiles
the sources changed since, and a new build removes the earlier ones. A CPU model runner
builds or loads them as it starts (``enable``); where that fails (no compiler, no ninja) it
logs one warning and every layer keeps torch's operations (``unavailable_reason`` says why).
Layers ask ``for_tensor(x)`` per call: the loaded module, or None.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import os
import platform
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("fused_ops.cpp", "decode_attention.cpp", "few_rows_matmul.cpp",
                             "blocked_matmul.cpp", "prefill_attention.cpp",
                             "prefill_attention_float32.cpp", "pair_matmul.cpp",
                             "decode_layer.cpp", "sandwich_decode_layers.cpp",
                             "lora_matmul.cpp", "argmax.cpp", "quantized_matmul.cpp",
                             "quantized_matmul_bf16.cpp", "bindings.cpp"))
BUILD_PREFIX = "radixlm_cpu_ops_"  # a build's directory and module: this and a digest
FUNCTIONS = ("rms_norm", "add_rms_norm", "paged_decode_attention", "rotary", "silu_mul",
             "scatter_rows", "int8_matmul", "dense_matmul", "blocked_matmul",
             "blocked_int8_matmul",
             "paged_prefill_attention", "prefill_attention_available", "pair_matmul",
             "int8_pair_matmul", "pair_matmul_silu", "int8_pair_matmul_silu",
             "pair_matmul_available", "decode_layer", "decode_layers", "sandwich_decode_layers",
             "lora_add",
             "argmax_rows", "quantized_matmul", "quantized_matmul_parts", "dequantize_blocks",
             "quantized_bf16_dots_serve")
COMPILER_FLAGS = ("-O3", "-march=native", "-fopenmp")


class ProjectionKernel(enum.IntEnum):
    """How ``decode_layer`` multiplies a projection's weight (``Projection`` in
    decode_projection.h, which switches on these values)."""

    PAIRS = 0  # pair_matmul(x, weight)
    INT8 = 1  # int8_matmul(x, weight, scales)
    DENSE = 2  # dense_matmul(x, weight)
    TORCH_LINEAR = 3  # torch's linear(x, weight), what F.linear runs
    INT8_PAIRS = 4  # int8_pair_matmul(x, weight, scales)
    BLOCKED = 5  # blocked_matmul(x, weight), weight in column blocks
    INT8_BLOCKED = 6  # blocked_int8_matmul(x, weight, scales), int8 column blocks
    GGUF = 7  # quantized_matmul_parts(x, parts, types): scales index the call's gguf_parts


OLD_BUILD_DAYS = 30
"""A build no process has loaded for this long is removed by the next new build."""
PAIR_COLUMNS = 16
"""Out features of one group of a weight laid out by column pairs (``pair_matmul``): one
512-bit vector of float32 sums."""
BLOCK_COLUMNS = 16
"""Out features of one column block of a weight (``blocked_matmul``)."""
PREFILL_MAX_VALUE_DIM = {torch.bfloat16: 128, torch.float32: 256}
"""The widest D_v ``paged_prefill_attention`` takes in each dtype (its rows' sums of values
stay on the stack; ``max_value_dim`` in prefill_attention.h)."""


_module: ModuleType | None = None
_loaded: ModuleType | None = None  # kept across disable() / enable()
_unavailable: str | None = None  # why they could not be built: not retried in this process
_vectorized = False  # the kernels built on AVX2 or AVX-512 vectors (causal_prefill_attention)


def active() -> ModuleType | None:
    """The kernels' module while enabled, else None."""
    return _module


def for_tensor(tensor: torch.Tensor) -> ModuleType | None:
    """The kernels' module if they are on and ``tensor`` is on a CPU (where a layer may
    call them), else None; None too while torch.compile traces (a traced layer takes its
    torch path, or an operator of ``models/layers/compiled_ops.py`` that calls in here)."""
    if _module is None or tensor.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    return _module


def causal_prefill_attention(keys: torch.Tensor, values: torch.Tensor,
                             pair_kernels: bool) -> Callable | None:
    """The kernels' ``paged_prefill_attention`` where it serves attention over ``keys`` (..., D)
    and ``values`` (..., D_v) (a KV pool's buffers), else None: the kernels on, a CPU, D even
    and D_v a multiple of 16, and

    - bfloat16: D_v up to 128, where the plan runs bfloat16 on the kernels (``pair_kernels``,
      ``execution_plan.CpuExecutionPlan``: a build with AVX-512 BF16 and a CPU without AMX,
      whose flash attention runs on AMX tiles through oneDNN);
    - float32: D_v up to 256 and a build with AVX2 or AVX-512 vectors (the kernel in
      ``prefill_attention_float32.cpp``)."""
    module = for_tensor(keys)
    if module is None or keys.dtype != values.dtype:
        return None
    dim, v_dim = keys.shape[-1], values.shape[-1]
    if dim % 2 or v_dim % 16:
        return None
    if keys.dtype == torch.bfloat16:
        serves = pair_kernels and v_dim <= PREFILL_MAX_VALUE_DIM[torch.bfloat16]
    else:
        serves = (keys.dtype == torch.float32 and _vectorized
                  and v_dim <= PREFILL_MAX_VALUE_DIM[torch.float32])
    return module.paged_prefill_attention if serves else None


def pair_kernels_pay() -> bool:
    """Whether the kernels' bfloat16 products by column pairs (and their bfloat16 prompt
    attention) pay here: the kernels on, a build with AVX-512 BF16, and a CPU without AMX
    (oneDNN's kernels run on AMX tiles there, and these are not measured there). A fact of
    the build and the CPU, read once by the runner's plan
    (``execution_plan.CpuExecutionPlan.pair_kernels``)."""
    return (_module is not None and _module.prefill_attention_available()
            and _module.pair_matmul_available() and "amx_bf16" not in _cpu_flags())


def enable() -> bool:
    """Builds (first time on this machine) or loads the kernels and turns them on for this
    process; returns whether they are on. Where they cannot be built, one warning says why
    (once a process) and torch's operations stay."""
    global _module, _loaded, _unavailable, _vectorized
    if _loaded is None and _unavailable is None:
        _unavailable = _missing_tool()
        if _unavailable is None:
            try:
                _loaded = _build()
            except Exception as error:  # a failed build: keep torch's operations
                logger.debug("fused CPU kernels: build output", exc_info=True)
                lines = str(error).strip().splitlines()
                _unavailable = f"the build failed ({lines[-1] if lines else type(error).__name__})"
        if _unavailable is not None:
            logger.warning("fused CPU kernels unavailable, using torch's operations: %s",
                           _unavailable)
    _module = _loaded
    _vectorized = _vector_capability(_cpu_flags()) != ["-DCPU_CAPABILITY=DEFAULT"]
    return _module is not None


def disable() -> None:
    """Turns the kernels off for this process (layers use torch's operations)."""
    global _module
    _module = None


def _missing_tool() -> str | None:
    """Why the kernels cannot be built here (a tool torch's builder needs is missing)."""
    from torch.utils.cpp_extension import is_ninja_available

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} not found)"
    if not is_ninja_available():
        return "ninja not found"
    return None


def unavailable_reason() -> str | None:
    """Why the kernels are not available in this process (no compiler, no ninja, a failed
    build), else None: they are built, or nothing stops a build (``enable`` builds them)."""
    if _loaded is not None:
        return None
    return _unavailable if _unavailable is not None else _missing_tool()


def compile_defines() -> list[str]:
    """The preprocessor definitions every source is compiled with: ATen's vector capability
    for this CPU and the constants Python shares with the kernels."""
    return [*_vector_capability(_cpu_flags()), *_shared_constants()]


def _shared_constants() -> list[str]:
    """The constants defined here that the kernels use, as -D flags, so that each has one
    definition: ``ProjectionKernel``'s values (``RADIXLM_PROJECTION_<NAME>``),
    ``PREFILL_MAX_VALUE_DIM``'s (``RADIXLM_PREFILL_MAX_VALUE_DIM_<DTYPE>``) and the column
    layouts' widths (``RADIXLM_PAIR_COLUMNS``, ``RADIXLM_BLOCK_COLUMNS``)."""
    projections = [f"-DRADIXLM_PROJECTION_{kernel.name}={kernel.value}"
                   for kernel in ProjectionKernel]
    value_dims = [f"-DRADIXLM_PREFILL_MAX_VALUE_DIM_{str(dtype).removeprefix('torch.').upper()}"
                  f"={dim}" for dtype, dim in PREFILL_MAX_VALUE_DIM.items()]
    widths = [f"-DRADIXLM_PAIR_COLUMNS={PAIR_COLUMNS}", f"-DRADIXLM_BLOCK_COLUMNS={BLOCK_COLUMNS}"]
    return [*projections, *value_dims, *widths]


def _build() -> ModuleType:
    """Builds (or finds built) and loads the module. Builders take turns on a lock the
    system drops with a process that dies, so a build killed half-way cannot leave the lock
    file of torch's builder behind to stall every later start. Each load marks its build as
    used (the lock's time); a new build removes builds unused for ``OLD_BUILD_DAYS``
    (``_remove_old_builds``)."""
    import fcntl

    from torch.utils.cpp_extension import load

    key = " ".join([torch.__version__, platform.python_version(), *_cpu_flags()])
    name = f"{BUILD_PREFIX}{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR")
                or Path.home() / ".cache" / "torch_extensions")
    directory = root / name
    while True:
        directory.mkdir(parents=True, exist_ok=True)
        lock_path = directory / "radixlm.lock"
        with open(lock_path, "w") as turn:
            fcntl.flock(turn, fcntl.LOCK_EX)
            if not _is_same_file(turn, lock_path):
                continue  # removed as an old build while this process waited: make it again
            os.utime(lock_path)  # used now
            fresh = not any(directory.glob(f"{name}*.so"))  # (torch adds _v1... on rebuilds)
            (directory / "lock").unlink(missing_ok=True)  # torch's, left by a killed build
            # torch's builder runs ninja, which recompiles the sources (and headers) changed
            # since the last build.
            module = load(
                name=name,
                sources=[str(source) for source in SOURCES],
                extra_cflags=[*COMPILER_FLAGS, *compile_defines()],
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
            )
        if fresh:
            _remove_old_builds(root, keep=directory)
        return module


def _is_same_file(opened, path: Path) -> bool:
    """Whether ``opened`` (a file object) is still the file at ``path``."""
    try:
        return os.path.samestat(os.fstat(opened.fileno()), os.stat(path))
    except FileNotFoundError:
        return False


def _remove_old_builds(root: Path, keep: Path) -> None:
    """Removes the builds in ``root`` other than ``keep`` that no process has loaded for
    ``OLD_BUILD_DAYS`` (earlier torch or Python versions, another CPU's flags): builds in
    use by another environment sharing the directory stay. One whose lock another process
    holds (building it now) is left too."""
    import fcntl

    unused_since = time.time() - OLD_BUILD_DAYS * 86400
    for old in root.glob(f"{BUILD_PREFIX}*"):
        if old == keep or old.is_symlink() or not old.is_dir():
            continue
        lock_path = old / "radixlm.lock"
        try:
            if lock_path.exists() and lock_path.stat().st_mtime > unused_since:
                continue  # loaded lately, by another torch, Python or CPU sharing the cache
            with open(lock_path, "a") as turn:
                fcntl.flock(turn, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(old)
        except OSError as error:  # locked by a builder, or not ours to remove
            logger.debug("fused CPU kernels: old build %s left (%s)", old, error)


def _cpu_flags() -> list[str]:
    """The CPU's instruction-set flags (Linux), else its name: code built with -march=native
    on one CPU is never loaded on another (the build's name carries their digest, with
    torch's and Python's versions, whose ABI it is built against)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].split()
    except OSError:
        pass
    return [platform.machine(), platform.processor()]


def _vector_capability(flags: list[str]) -> list[str]:
    """The ATen SIMD vectors to compile against (torch builds its own kernels per capability
    the same way): AVX-512 or AVX2 where the CPU has them, else ATen's portable default."""
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= set(flags):
        name = "AVX512"
    elif {"avx2", "fma"} <= set(flags):
        name = "AVX2"
    else:
        return ["-DCPU_CAPABILITY=DEFAULT"]
    return [f"-DCPU_CAPABILITY={name}", f"-DCPU_CAPABILITY_{name}"]
