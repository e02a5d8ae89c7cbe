"""GPU decode: attention's achieved memory bandwidth and a ~1B model's tokens/s with CUDA graphs.

Three measurements in one run (issue 9), each printed as a table, then one JSON line:

1. copy bandwidth: a large device-to-device copy, timed with CUDA events; reported as bytes
   read + written per second, the traffic a memory-bound kernel can hope for;
2. decode attention, one layer, per backend (torch_native, triton, flashinfer where it
   imports and the dtype is 16-bit) and page size: a batch of requests of equal context
   scattered over a random page table in a larger pool; time per ``forward_decode`` call,
   KV bytes read (B x ctx x 2 x H_kv x D x element size) per second, and that as a fraction
   of the copy bandwidth; outputs are compared with torch_native's and triton's (max abs
   difference);
3. decode throughput of a randomly initialised Llama of about 1.1B parameters written here
   (config, bf16 safetensors, a byte-level tokenizer): one Engine per backend with CUDA
   graphs and one without, all alive at once, runs interleaved; decode tokens/s is
   B x (N - 1) / (t(N tokens) - t(1 token)), so prefill and start-up cancel out.

    python benchmarks/bench_gpu_decode.py                  # on a CUDA machine, a few min
    python benchmarks/bench_gpu_decode.py --parts attention --page-sizes 16
    python benchmarks/bench_gpu_decode.py --smoke          # CPU, tiny shapes, Triton interpreted

``--smoke`` runs the same code paths on a CPU (Triton under its interpreter, perf_counter
instead of CUDA events, float32, a 2-layer model); its figures mean nothing. Without CUDA
and without ``--smoke`` the script exits with status 2. Otherwise every part runs and the
JSON line prints, and the script exits 1 if any error was recorded (``report_errors``: a
part that raised, a backend's failed row, an engine that failed), else 0; a backend left
out (flashinfer absent, or a dtype it has no kernels for) is not an error.

To run on any machine with an NVIDIA GPU and its driver, from a checkout of radixlm:

    pip install -e '.[gpu]'   # torch>=2.5 built for CUDA, triton>=3.0, flashinfer-python
    python benchmarks/bench_gpu_decode.py 2>&1 | tee bench_gpu_decode.log

The model is written by the script (random weights), nothing is downloaded. Without the
flashinfer package its rows are left out; FlashInfer is measured by default only in
float16 or bfloat16 (``--dtype``), the dtypes it has kernels for
(``backend_selection.FLASHINFER_DTYPES``). Results go to ``benchmarks/RESULTS.md`` with the
GPU, the versions of torch, triton and flashinfer, the flags and the date.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

# ~1.1B parameters: 16 x 62.9M per layer + 2 x 65.5M embedding / LM head.
MODEL_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=32000)
MODEL_SMOKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
SMOKE_SHAPES = dict(copy_mib=16, batch=4, context=48, heads=8, kv_heads=2, head_dim=32,
                    warmup=1, iters=2, decode_batches=[1, 2], prompt_len=16, new_tokens=4,
                    repeats=1, dtype="float32")


def seconds_per_call(fn: Callable[[], object], device: torch.device, warmup: int,
                     iters: int) -> float:
    """Mean seconds of one ``fn()``: CUDA events around ``iters`` calls on GPUs, else the
    wall clock."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def error_text(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}".splitlines()[0][:160]


# 1. Copy bandwidth -----------------------------------------------------------------------


def copy_bandwidth(device: torch.device, num_bytes: int, iters: int) -> float:
    """GB/s (1e9 bytes) of bytes read + written by ``dst.copy_(src)`` of ``num_bytes``."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    seconds = seconds_per_call(lambda: dst.copy_(src), device, warmup=2, iters=iters)
    return 2 * num_bytes / seconds / 1e9


# 2. Decode attention ---------------------------------------------------------------------


@dataclasses.dataclass
class DecodeCase:
    """One decode step of one layer: the batch, the new token's q/k/v, the layer."""

    batch: object  # ForwardBatch
    q: torch.Tensor  # (B, H, D)
    k: torch.Tensor  # (B, H_kv, D)
    v: torch.Tensor  # (B, H_kv, D)
    layer: object  # PagedAttention
    kv_bytes: int  # bytes of K and V the step reads


def decode_case(batch_size: int, context: int, heads: int, kv_heads: int, head_dim: int,
                page_size: int, dtype: torch.dtype, device: torch.device, seed: int) -> DecodeCase:
    """Requests of ``context`` tokens (the last one new) on random pages of a pool with a
    quarter more pages than they need, in random rows of the index table, as the allocator
    lays them out: token i at offset i % page_size of the request's (i // page_size)-th page."""
    from radixlm.kernels.attention.torch_native_backend import TorchNativeAttentionBackend
    from radixlm.kernels.forward_batch import ForwardBatch, ForwardMode
    from radixlm.kv_cache.memory_pool import MHATokenToKVPool
    from radixlm.models.layers.attention import PagedAttention

    gen = torch.Generator(device=device).manual_seed(seed)
    pages_per_req = -(-context // page_size)
    num_pages = batch_size * pages_per_req * 5 // 4 + 1
    pool = MHATokenToKVPool((num_pages + 1) * page_size, 1, kv_heads, head_dim, dtype, device)
    pool.k_buffers[0].normal_(generator=gen)
    pool.v_buffers[0].normal_(generator=gen)
    pages = torch.randperm(num_pages, generator=gen, device=device)[
        : batch_size * pages_per_req] + 1  # page 0 is the padding page
    offsets = torch.arange(page_size, device=device)
    slots = (pages.view(batch_size, pages_per_req, 1) * page_size + offsets).view(batch_size, -1)
    rows = torch.randperm(2 * batch_size, generator=gen, device=device)[:batch_size]
    req_to_token = torch.zeros(2 * batch_size, context, dtype=torch.int64, device=device)
    req_to_token[rows] = slots[:, :context]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    lens = torch.full((batch_size,), context, dtype=torch.int64, device=device)
    batch = ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=torch.zeros(batch_size, dtype=torch.int64, device=device),
        positions=lens - 1,
        out_cache_loc=req_to_token[rows, context - 1].clone(),
        req_pool_indices=rows,
        seq_lens=lens,
        prefix_lens=lens - 1,
        extend_seq_lens=torch.ones_like(lens),
        req_to_token=req_to_token,
        kv_pool=pool,
        attn_backend=TorchNativeAttentionBackend(),
        seq_lens_list=[context] * batch_size,
        extend_seq_lens_list=[1] * batch_size,
    )
    layer = PagedAttention(0, heads, kv_heads, head_dim, head_dim**-0.5)
    kv_bytes = batch_size * context * 2 * kv_heads * head_dim * pool.k_buffers[0].element_size()
    return DecodeCase(batch, randn(batch_size, heads, head_dim),
                      randn(batch_size, kv_heads, head_dim), randn(batch_size, kv_heads, head_dim),
                      layer, kv_bytes)


def bench_attention(case: DecodeCase, backend_names: list[str], page_size: int,
                    device: torch.device, warmup: int, iters: int) -> list[dict]:
    """One row per backend: plan ms, ms per decode call, KV GB/s, and the max abs difference
    of its output from torch_native's and from triton's.

    Every backend stores the same k/v into the same slots, so all read the same pool.
    """
    from radixlm.kernels.attention.backend_selection import create_backend

    layer, rows, outputs = case.layer, [], {}
    for name in ["torch_native"] + [n for n in backend_names if n != "torch_native"]:
        row: dict = {"backend": name, "page_size": page_size}
        rows.append(row)
        try:
            backend = create_backend(
                name, device, num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads,
                head_dim=layer.head_dim, page_size=page_size, dtype=case.q.dtype,
                scaling=layer.scaling,
            )
            batch = dataclasses.replace(case.batch, attn_backend=backend)
            start = time.perf_counter()
            backend.init_forward_metadata(batch)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            row["plan_ms"] = (time.perf_counter() - start) * 1e3

            def call(backend=backend, batch=batch):
                return backend.forward_decode(case.q, case.k, case.v, layer, batch)

            with torch.inference_mode():
                out = call().float()
                seconds = seconds_per_call(call, device, warmup, iters)
            row["ms"] = seconds * 1e3
            row["kv_gbps"] = case.kv_bytes / seconds / 1e9
            row["max_abs_out"] = out.abs().max().item()
            outputs[name] = out
        except Exception as err:  # a failing backend is a row in the table, not a crash
            row["error"] = error_text(err)
    for row in rows:
        for other in ("torch_native", "triton"):
            if row["backend"] in outputs and other in outputs:
                diff = (outputs[row["backend"]] - outputs[other]).abs().max().item()
                row[f"max_abs_diff_vs_{other}"] = diff
    return rows


# 3. Decode throughput of a ~1B model ----------------------------------------------------


def byte_tokenizer():
    """A byte-level BPE tokenizer without merges: 256 byte tokens and an end-of-text token.
    The model's vocabulary may be larger; ids past the tokenizer's decode to nothing."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<|endoftext|>": 0, **{ch: i + 1 for i, ch in enumerate(alphabet)}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    )


def write_random_llama(directory: Path, dims: dict, dtype: torch.dtype,
                       device: torch.device, context: int) -> int:
    """Writes a randomly initialised Llama (config, safetensors in ``dtype``, tokenizer) to
    ``directory``, initialising it on ``device``; returns its parameter count."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    config = transformers.LlamaConfig(
        **dims, max_position_embeddings=context, tie_word_embeddings=False,
        eos_token_id=0, bos_token_id=0, architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    params = sum(p.numel() for p in model.parameters())
    model.to("cpu").save_pretrained(directory, safe_serialization=True)
    byte_tokenizer().save_pretrained(directory)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return params


def generate_seconds(engine, prompts: list[list[int]], new_tokens: int) -> float:
    params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    start = time.perf_counter()
    outputs = engine.generate(input_ids=prompts, sampling_params=params)
    elapsed = time.perf_counter() - start
    if any(len(o["output_ids"]) != new_tokens for o in outputs):
        raise RuntimeError(f"an output is not {new_tokens} tokens long")
    return elapsed


def bench_model_decode(model_dir: Path, backends: list[str], device: torch.device,
                       args: argparse.Namespace, vocab: int, weight_bytes: int) -> list[dict]:
    """Decode tokens/s per (backend, batch), with CUDA graphs and without, interleaved;
    with graphs, also the weights' bytes per step time (what batch 1 is bound by)."""
    import radixlm

    max_batch = max(args.decode_batches)
    context = args.prompt_len + args.new_tokens + 16
    engines: dict[tuple[str, bool], object] = {}
    failures: dict[tuple[str, bool], str] = {}
    for backend in backends:
        for graphs in (True, False):
            start = time.perf_counter()
            try:
                engines[backend, graphs] = radixlm.Engine(
                    str(model_dir), attention_backend=backend, disable_cuda_graph=not graphs,
                    dtype=args.dtype, device=device.type, context_length=context,
                    max_running_requests=max_batch, cuda_graph_max_bs=max_batch,
                    max_total_tokens=2 * max_batch * context, disable_radix_cache=True,
                )
                print(f"  engine {backend} graphs={graphs} ready in "
                      f"{time.perf_counter() - start:.0f} s", flush=True)
            except Exception as err:
                failures[backend, graphs] = error_text(err)
                print(f"  engine {backend} graphs={graphs} failed: {failures[backend, graphs]}",
                      flush=True)
    steps: dict[tuple[str, bool, int], list[float]] = {}
    gen = torch.Generator().manual_seed(0)
    try:
        for repeat in range(-1, args.repeats):  # repeat -1: warm-up, not recorded
            for batch in args.decode_batches:
                prompts = torch.randint(1, vocab, (batch, args.prompt_len), generator=gen)
                for key, engine in engines.items():
                    if key in failures:
                        continue
                    try:
                        first = generate_seconds(engine, prompts.tolist(), 1)
                        full = generate_seconds(engine, prompts.tolist(), args.new_tokens)
                    except Exception as err:
                        failures[key] = error_text(err)
                        continue
                    if repeat >= 0:
                        step = (full - first) / (args.new_tokens - 1)
                        steps.setdefault((*key, batch), []).append(step)
    finally:
        for engine in engines.values():
            engine.shutdown()
    rows = []
    for backend in backends:
        for batch in args.decode_batches:
            row: dict = {"backend": backend, "batch": batch}
            for graphs, label in ((True, "graphs"), (False, "eager")):
                if (backend, graphs) in failures:
                    row[f"{label}_error"] = failures[backend, graphs]
                elif (backend, graphs, batch) in steps:
                    step = statistics.median(steps[backend, graphs, batch])
                    row[f"{label}_ms_per_step"] = step * 1e3
                    row[f"{label}_tok_s"] = batch / step if step > 0 else float("nan")
            if "graphs_ms_per_step" in row:
                row["graphs_weight_gbps"] = weight_bytes / row["graphs_ms_per_step"] / 1e6
            if "graphs_tok_s" in row and "eager_tok_s" in row:
                row["graph_speedup"] = row["graphs_tok_s"] / row["eager_tok_s"]
            rows.append(row)
    return rows


# Report ----------------------------------------------------------------------------------


def report_errors(report: dict) -> list[str]:
    """Every error ``report`` records: a part's own (``<part>_error``, the part raised) and
    its rows' (``error`` in an attention row, ``graphs_error`` / ``eager_error`` in a decode
    row)."""
    errors = [f"{key}: {value}" for key, value in report.items() if key.endswith("_error")]
    for part, size in (("attention", "page_size"), ("decode", "batch")):
        for row in report.get(part, []):
            where = f"{part} {row['backend']} {size} {row[size]}"
            errors += [f"{where}: {key}: {value}" for key, value in row.items()
                       if key == "error" or key.endswith("_error")]
    return errors


def fmt(row: dict, key: str, spec: str, width: int) -> str:
    value = row.get(key)
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def print_attention(rows: list[dict]) -> None:
    print(f"{'backend':<13} {'page':>4} {'plan ms':>8} {'ms/call':>8} {'KV GB/s':>8} "
          f"{'of copy':>7} {'max|out|':>8} {'max|diff| vs torch / triton':>27}")
    for row in rows:
        line = (f"{row['backend']:<13} {row['page_size']:>4} {fmt(row, 'plan_ms', '.3f', 8)} "
                f"{fmt(row, 'ms', '.3f', 8)} {fmt(row, 'kv_gbps', '.0f', 8)} "
                f"{fmt(row, 'fraction_of_copy', '.0%', 7)} {fmt(row, 'max_abs_out', '.3f', 8)} "
                f"{fmt(row, 'max_abs_diff_vs_torch_native', '.2e', 17)} / "
                f"{fmt(row, 'max_abs_diff_vs_triton', '.2e', 8)}")
        print(line + (f"  FAILED {row['error']}" if "error" in row else ""), flush=True)


def print_decode(rows: list[dict]) -> None:
    print(f"{'backend':<11} {'batch':>5} {'graphs tok/s':>12} {'eager tok/s':>11} {'ratio':>6} "
          f"{'graphs ms/step':>14} {'eager ms/step':>13} {'weights GB/s':>12}")
    for row in rows:
        line = (f"{row['backend']:<11} {row['batch']:>5} {fmt(row, 'graphs_tok_s', '.1f', 12)} "
                f"{fmt(row, 'eager_tok_s', '.1f', 11)} {fmt(row, 'graph_speedup', '.2f', 6)} "
                f"{fmt(row, 'graphs_ms_per_step', '.2f', 14)} "
                f"{fmt(row, 'eager_ms_per_step', '.2f', 13)} "
                f"{fmt(row, 'graphs_weight_gbps', '.0f', 12)}")
        errors = [f"{k}: {v}" for k, v in row.items() if k.endswith("_error")]
        print(line + (f"  FAILED {'; '.join(errors)}" if errors else ""), flush=True)


def run_copy(args: argparse.Namespace, device: torch.device, report: dict) -> None:
    report["copy_gbps"] = gbps = copy_bandwidth(device, args.copy_mib * 2**20, iters=10)
    print(f"\ncopy {args.copy_mib} MiB device to device: {gbps:.0f} GB/s "
          "(bytes read + written)", flush=True)


def run_attention(args: argparse.Namespace, device: torch.device, report: dict) -> None:
    report["attention"] = []
    print(f"\ndecode attention, one layer: batch {args.batch}, context {args.context}, "
          f"{args.heads}/{args.kv_heads} heads of {args.head_dim}, {args.dtype}", flush=True)
    for page_size in args.page_sizes:
        case = decode_case(args.batch, args.context, args.heads, args.kv_heads, args.head_dim,
                           page_size, getattr(torch, args.dtype), device, seed=page_size)
        rows = bench_attention(case, args.backends, page_size, device, args.warmup, args.iters)
        for row in rows:
            if report.get("copy_gbps") and "kv_gbps" in row:
                row["fraction_of_copy"] = row["kv_gbps"] / report["copy_gbps"]
        print_attention(rows)
        report["attention"] += rows
        report["kv_bytes_per_call"] = case.kv_bytes
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()


def run_model(args: argparse.Namespace, device: torch.device, report: dict) -> None:
    dims, dtype = MODEL_SMOKE if args.smoke else MODEL_1B, getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory(prefix="radixlm-bench-") as tmp:
        start = time.perf_counter()
        context = args.prompt_len + args.new_tokens + 16
        report["model_params"] = params = write_random_llama(Path(tmp), dims, dtype, device,
                                                             context)
        print(f"\nrandom Llama, {params / 1e6:,.1f}M parameters ({dims}), written in "
              f"{time.perf_counter() - start:.0f} s; prompts of {args.prompt_len}, "
              f"{args.new_tokens} new tokens, median of {args.repeats}", flush=True)
        rows = bench_model_decode(Path(tmp), args.backends, device, args, dims["vocab_size"],
                                  params * dtype.itemsize)
    print_decode(rows)
    report["decode"] = rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, tiny shapes, Triton interpreted: checks the code paths only")
    parser.add_argument("--parts", nargs="+", default=["copy", "attention", "model"],
                        choices=["copy", "attention", "model"])
    parser.add_argument("--backends", nargs="+", default=None,
                        help="kernel backends to measure (default: triton, and flashinfer "
                             "where it imports and the dtype is 16-bit)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--copy-mib", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.smoke:
        for name, value in SMOKE_SHAPES.items():
            setattr(args, name, value)
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (decode time is t(N) - t(1))")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:
        # triton.jit picks the interpreter when radixlm's kernel modules are imported: now.
        os.environ["TRITON_INTERPRET"] = "1"
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        print("bench_gpu_decode needs a CUDA GPU; run with --smoke to check its code paths "
              "on a CPU", file=sys.stderr)
        return 2
    if args.backends is None:
        from radixlm.kernels.attention.backend_selection import FLASHINFER_DTYPES

        args.backends = ["triton"]
        if (device.type == "cuda" and importlib.util.find_spec("flashinfer") is not None
                and getattr(torch, args.dtype) in FLASHINFER_DTYPES):
            args.backends.append("flashinfer")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke)"
    print(f"device {name}; torch {torch.__version__}; backends {args.backends}", flush=True)
    report: dict = {"device": name, "dtype": args.dtype, "smoke": args.smoke}
    parts = {"copy": run_copy, "attention": run_attention, "model": run_model}
    for part in args.parts:
        try:
            parts[part](args, device, report)
        except Exception as err:  # the other parts still run; the JSON line still prints
            report[f"{part}_error"] = error_text(err)
            print(f"\n{part} FAILED: {report[f'{part}_error']}", flush=True)
    print(json.dumps(report), flush=True)
    errors = report_errors(report)
    for error in errors:  # after the JSON line, which stays stdout's last
        print(f"error: {error}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
