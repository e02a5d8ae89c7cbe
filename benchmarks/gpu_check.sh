#!/usr/bin/env bash
# The prepared device check (issue 58): what radixlm's GPU paths do on a real CUDA GPU, in
# one run, written to ONE file.
#
#   benchmarks/gpu_check.sh [RESULT_FILE]    # default: $OUT/gpu_check.txt, else ./gpu_check.txt
#
# Parts, each under its own time limit (their sum with the environment's is 480 s), each ending
# in a line "-- <part>: exit <rc> in <s> s" and summed up at the end of the file. The limits
# are budgets set before any GPU run, not measurements: the first GPU run's "-- <part>" lines
# calibrate them.
#   environment      nvidia-smi; python, torch (and its CUDA), triton, flashinfer versions;
#                    whether flashinfer imports, and whether its kernels come prebuilt
#                    (flashinfer-jit-cache / flashinfer-cubin, a filled JIT cache): without
#                    them FlashInfer compiles on first use, which may not fit a part's limit
#   agreement        benchmarks/gpu_kernel_agreement.py: decode, extend, MLA and fused-MoE
#                    kernels against torch references at real shapes, bf16 and float32
#                    (and FlashInfer's decode / extend where it imports)
#   kernel_tests     pytest -m triton tests/kernels on the GPU (the kernel tests put their
#                    tensors on CUDA there; the compile checks run too)
#   engine_tests     pytest tests/runtime/engine/test_engine_on_cuda.py -k "triton or bfloat16"
#                    (the Triton and bf16-graph cases; the rest of the file is left out
#                    to stay within the limit)
#   host_tier        pytest -k cuda tests/kv_cache/test_host_kv_blocks.py and
#                    test_disk_kv_store.py: the hierarchical cache's pinned host tier (its
#                    write-backs on a side stream, no host wait) and the disk tier from CUDA
#   host_waits       benchmarks/gpu_host_waits.py: host waits per decode step on every thread
#                    (what torch.cuda.set_sync_debug_mode("warn") flags, and event and
#                    device synchronizations), overlap and CUDA graphs on / off
#   flashinfer_vs_triton
#                    benchmarks/bench_gpu_decode.py --parts attention: FlashInfer's decode
#                    against Triton's and torch's (max abs difference, time per call); without
#                    flashinfer, Triton against torch alone; a backend's failed row fails it
# Without CUDA it writes the versions and "no CUDA: skipped" and exits 0. With CUDA it
# exits 1 when a part fails or runs out of time.
set -u
cd "$(dirname "$0")/.."
RESULT="${1:-${OUT:-.}/gpu_check.txt}"
mkdir -p "$(dirname "$RESULT")"
: > "$RESULT"
unset TRITON_INTERPRET  # kernels compile for the GPU here
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's radixlm, installed or not
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
PYTHON="${PYTHON:-python}"
FAILED=()
SUMMARY=()

log() { echo "$*" | tee -a "$RESULT"; }

part() {  # part NAME LIMIT_SECONDS COMMAND...
  local name=$1 limit=$2 start rc
  shift 2
  log ""
  log "== $name (limit ${limit} s): $*"
  start=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >> "$RESULT" 2>&1
  rc=$?
  [ "$rc" -eq 124 ] && log "TIMED OUT after ${limit} s"
  log "-- $name: exit $rc in $(( $(date +%s) - start )) s"
  SUMMARY+=("$name: exit $rc")
  [ "$rc" -eq 0 ] || FAILED+=("$name")
}

versions() {
  "$PYTHON" - <<'EOF'
import importlib, platform, sys
print(f"python {platform.python_version()} ({sys.executable})")
try:
    import torch
    print(f"torch {torch.__version__}, built for CUDA {torch.version.cuda}, "
          f"cuda available: {torch.cuda.is_available()}")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        print(f"device 0: {props.name}, sm_{props.major}{props.minor}, "
              f"{props.total_memory / 2**30:.0f} GiB, shared memory per block "
              f"{getattr(props, 'shared_memory_per_block_optin', 'unknown')} bytes")
except Exception as err:
    print(f"torch: {type(err).__name__}: {err}")
for name in ("triton", "flashinfer", "transformers"):
    try:
        module = importlib.import_module(name)
        print(f"{name} {getattr(module, '__version__', '?')}: imports")
    except Exception as err:
        print(f"{name}: does not import ({type(err).__name__}: {err})")
# FlashInfer without prebuilt kernels compiles each one (nvcc) on first use.
from importlib import metadata
from pathlib import Path
import os, shutil
for dist in ("flashinfer-python", "flashinfer-jit-cache", "flashinfer-cubin"):
    try:
        print(f"{dist} {metadata.version(dist)}: installed")
    except metadata.PackageNotFoundError:
        print(f"{dist}: not installed")
cache = Path(os.environ.get("FLASHINFER_WORKSPACE_BASE") or Path.home()) / ".cache" / "flashinfer"
built = sum(1 for _ in cache.rglob("*.so")) if cache.is_dir() else 0
print(f"flashinfer JIT cache {cache}: {built} compiled module(s); nvcc: {shutil.which('nvcc')}")
EOF
}

log "radixlm gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" \
    > /dev/null 2>&1; then
  versions >> "$RESULT" 2>&1
  log "no CUDA: skipped"
  exit 0
fi

log ""
log "== environment"
{ timeout 15 nvidia-smi || echo "nvidia-smi: failed or not found"; versions; } >> "$RESULT" 2>&1
part agreement 75 "$PYTHON" benchmarks/gpu_kernel_agreement.py
part kernel_tests 90 "$PYTHON" -m pytest -q -p no:cacheprovider -m "triton and not slow" \
  tests/kernels
part engine_tests 180 "$PYTHON" -m pytest -q -p no:cacheprovider --durations=5 \
  -k "triton or bfloat16" tests/runtime/engine/test_engine_on_cuda.py
part host_tier 30 "$PYTHON" -m pytest -q -p no:cacheprovider -k cuda \
  tests/kv_cache/test_host_kv_blocks.py tests/kv_cache/test_disk_kv_store.py
part host_waits 45 "$PYTHON" benchmarks/gpu_host_waits.py
part flashinfer_vs_triton 45 "$PYTHON" benchmarks/bench_gpu_decode.py --parts attention \
  --batch 32 --context 2048 --page-sizes 16 --warmup 2 --iters 10

log ""
log "== summary"
for line in "${SUMMARY[@]}"; do log "$line"; done
if [ "${#FAILED[@]}" -gt 0 ]; then
  log "gpu_check: ${#FAILED[@]} part(s) failed: ${FAILED[*]}"
  exit 1
fi
log "gpu_check: every part passed"
