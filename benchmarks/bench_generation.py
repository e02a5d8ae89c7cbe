"""radixlm vs transformers on the default model: batch-1 decode and batch-16 throughput.

Both run in this process on the same converted weights, alternating run by run, so the
ratios hold even on a shared, noisy machine. Absolute figures are printed for context only.

radixlm picks its CPU threads per forward pass (one for small batches); transformers runs
twice, with all of torch's threads (its default, the reference configuration) and with one
thread (its best on a small, shared CPU), so both ratios are shown.

    python benchmarks/bench_generation.py [--dtypes bfloat16 float32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import transformers  # noqa: E402

import radixlm  # noqa: E402
from radixlm.models.default_model import default_model_path  # noqa: E402

PROMPT = "The history of the city of Paris"
BATCH_PROMPTS = [f"Write a short note about topic number {i}: " for i in range(16)]


def radixlm_run(engine: radixlm.Engine, prompts: list[str], new_tokens: int) -> float:
    """Seconds to generate ``new_tokens`` for every prompt, all in one batch."""
    params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o["output_ids"]) == new_tokens for o in outputs)
    return elapsed


def transformers_run(
    model, tokenizer, prompts: list[str], new_tokens: int, threads: int
) -> float:
    torch.set_num_threads(threads)
    inputs = tokenizer(prompts, return_tensors="pt", padding=True)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            **inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    elapsed = time.perf_counter() - start
    assert out.shape[1] - inputs["input_ids"].shape[1] == new_tokens
    return elapsed


def compare(engine, model, tokenizer, prompts, new_tokens, repeats, thread_counts):
    """Median output tokens/s of radixlm and of transformers at each thread count,
    runs interleaved."""
    total = len(prompts) * new_tokens
    ours: list[float] = []
    theirs: dict[int, list[float]] = {t: [] for t in thread_counts}
    radixlm_run(engine, prompts, 4)  # warm-up
    for threads in thread_counts:
        transformers_run(model, tokenizer, prompts, 4, threads)
    for _ in range(repeats):
        ours.append(total / radixlm_run(engine, prompts, new_tokens))
        for threads in thread_counts:
            elapsed = transformers_run(model, tokenizer, prompts, new_tokens, threads)
            theirs[threads].append(total / elapsed)
    return statistics.median(ours), {t: statistics.median(v) for t, v in theirs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--batch-tokens", type=int, default=64)
    args = parser.parse_args()
    path = default_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, padding_side="left")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    all_threads = torch.get_num_threads()
    thread_counts = sorted({all_threads, 1}, reverse=True)
    print(f"model {path}; transformers at {thread_counts} threads")
    header = f"{'dtype':<9} {'workload':<20} {'radixlm':>8}"
    for t in thread_counts:
        header += f" {f'hf@{t}thr':>9} {'ratio':>6}"
    print(header + "   (output tokens/s)")
    for dtype in args.dtypes:
        engine = radixlm.Engine(str(path), dtype=dtype, max_total_tokens=16 * 512)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, dtype)
        ).eval()
        workloads = [
            ("batch 1 decode", [PROMPT], args.decode_tokens),
            ("batch 16 throughput", BATCH_PROMPTS, args.batch_tokens),
        ]
        for name, prompts, new_tokens in workloads:
            ours, theirs = compare(
                engine, model, tokenizer, prompts, new_tokens, args.repeats, thread_counts
            )
            line = f"{dtype:<9} {name:<20} {ours:>8.1f}"
            for t in thread_counts:
                line += f" {theirs[t]:>9.1f} {ours / theirs[t]:>5.2f}x"
            print(line, flush=True)
        engine.shutdown()
        del model

if __name__ == "__main__":
    main()
