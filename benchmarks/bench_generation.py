"""radixlm vs transformers on the default model: batch-1 decode and batch-16 throughput.

Both run in this process on the same converted weights, alternating run by run, so the
ratios hold even on a shared, noisy machine. Absolute figures are printed for context only.

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


def transformers_run(model, tokenizer, prompts: list[str], new_tokens: int) -> float:
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


def compare(engine, model, tokenizer, prompts, new_tokens, repeats) -> tuple[float, float]:
    """Median output tokens/s of (radixlm, transformers), runs interleaved."""
    ours, theirs = [], []
    total = len(prompts) * new_tokens
    radixlm_run(engine, prompts, 4)  # warm-up
    transformers_run(model, tokenizer, prompts, 4)
    for _ in range(repeats):
        ours.append(total / radixlm_run(engine, prompts, new_tokens))
        theirs.append(total / transformers_run(model, tokenizer, prompts, new_tokens))
    return statistics.median(ours), statistics.median(theirs)


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
    print(f"model {path}, torch threads {torch.get_num_threads()}")
    print(f"{'dtype':<9} {'workload':<22} {'radixlm tok/s':>14} {'transformers':>13} {'ratio':>7}")
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
            ours, theirs = compare(engine, model, tokenizer, prompts, new_tokens, args.repeats)
            print(f"{dtype:<9} {name:<22} {ours:>14.1f} {theirs:>13.1f} {ours / theirs:>6.2f}x")
        engine.shutdown()
        del model


if __name__ == "__main__":
    main()
