"""Batching on the default model: continuous vs static, and radixlm vs transformers.

(a) Continuous vs static batching, on the same engine options but ``batching``: 32
    requests with output budgets drawn from [4, 128] (ignore_eos), eight running at most,
    submitted as one streamed ``generate`` call. Throughput is output tokens over the wall
    time; a request's latency is the time its final chunk arrives, from the call's start.
(b) radixlm (one ``generate`` call over every request) vs transformers' batched
    ``generate`` (batches of 16 in arrival order, left padding), on requests with prompts of
    16-256 tokens and outputs of 16-128 tokens. transformers generates every row of a batch
    to the batch's longest budget; only the requested tokens count as output for both.

Both run in this process, one after the other, on the same converted weights, in
``--dtype`` (default ``auto``: radixlm's own choice for this CPU, and transformers in the
dtype it resolves to, bfloat16 with native bf16, else float32). Prompts are
random token ids (no two share a prefix, so the prefix cache gives radixlm nothing).

    python benchmarks/bench_batching.py [--requests 256] [--repeats 1] [--dtype auto]
"""

# ruff: noqa: I001 - radixlm is imported before torch, for the reason given there

from __future__ import annotations

import argparse
import random
import statistics
import time

# First: importing radixlm sets its OpenMP wait (radixlm/__init__.py), which must precede
# torch's loading to apply to this process (transformers included) and its servers.
import radixlm  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402

from radixlm.models.default_model import default_model_path  # noqa: E402
from radixlm.runtime.server_args import ServerArgs  # noqa: E402

HF_BATCH = 16


def random_prompts(rng: random.Random, count: int, low: int, high: int,
                   vocab: int) -> list[list[int]]:
    # Ids above the special tokens (SmolLM2 keeps its 17 specials at the start).
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(low, high))]
            for _ in range(count)]


def greedy(max_new_tokens: int) -> dict:
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}


def streamed_run(engine: radixlm.Engine, prompts: list[list[int]],
                 budgets: list[int]) -> tuple[float, list[float]]:
    """(wall seconds, per-request seconds until its final chunk) for one streamed call."""
    finished: dict[int, float] = {}
    start = time.perf_counter()
    for chunk in engine.generate(input_ids=prompts, sampling_params=[greedy(n) for n in budgets],
                                 stream=True):
        if chunk["meta_info"]["finish_reason"] is not None:
            finished[chunk["index"]] = time.perf_counter() - start
            assert chunk["meta_info"]["completion_tokens"] == budgets[chunk["index"]]
    wall = time.perf_counter() - start
    assert len(finished) == len(prompts)
    return wall, [finished[i] for i in range(len(prompts))]


def compare_batching(path, args, rng: random.Random) -> None:
    vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
    prompts = random_prompts(rng, 32, 16, 64, vocab)
    budgets = [rng.randint(4, 128) for _ in prompts]
    total = sum(budgets)
    engines = {
        mode: radixlm.Engine(str(path), dtype=args.dtype, batching=mode, max_running_requests=8,
                             max_total_tokens=8 * 256)
        for mode in ("continuous", "static")
    }
    results: dict[str, list[tuple[float, float]]] = {mode: [] for mode in engines}
    for engine in engines.values():  # warm-up
        streamed_run(engine, prompts[:4], [4] * 4)
    for _ in range(args.repeats):
        for mode, engine in engines.items():  # interleaved, repeat by repeat
            engine.flush_cache()
            wall, latencies = streamed_run(engine, prompts, budgets)
            results[mode].append((total / wall, statistics.mean(latencies)))
    for engine in engines.values():
        engine.shutdown()
    print(f"\n(a) 32 requests, prompts 16-64 tokens, outputs 4-128 tokens ({total} in all), "
          f"8 running at most, {args.dtype}; median of {args.repeats}")
    print(f"{'batching':<12} {'output tok/s':>13} {'mean latency s':>15}")
    summary = {}
    for mode, runs in results.items():
        throughput = statistics.median(r[0] for r in runs)
        latency = statistics.median(r[1] for r in runs)
        summary[mode] = (throughput, latency)
        print(f"{mode:<12} {throughput:>13.1f} {latency:>15.2f}")
    (ct, cl), (st, sl) = summary["continuous"], summary["static"]
    print(f"{'ratio c/s':<12} {ct / st:>12.2f}x {cl / sl:>14.2f}x")


def transformers_run(model, prompts: list[list[int]], budgets: list[int], pad_id: int) -> float:
    """Seconds for transformers to serve the requests in batches of HF_BATCH."""
    start = time.perf_counter()
    for first in range(0, len(prompts), HF_BATCH):
        batch = prompts[first : first + HF_BATCH]
        new_tokens = max(budgets[first : first + HF_BATCH])
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids, attention_mask=mask, max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id,
            )
        assert out.shape[1] == width + new_tokens
    return time.perf_counter() - start


def compare_with_transformers(path, args, rng: random.Random, threads: int) -> None:
    """transformers runs with all of torch's threads (its default configuration)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (
        tokenizer.eos_token_id
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=ServerArgs(device="cpu", dtype=args.dtype).resolved_dtype()
    ).eval()
    prompts = random_prompts(rng, args.requests, 16, 256, model.config.vocab_size)
    budgets = [rng.randint(16, 128) for _ in prompts]
    total = sum(budgets)
    engine = radixlm.Engine(str(path), dtype=args.dtype, max_total_tokens=64 * 512)
    engine.generate(input_ids=prompts[:4], sampling_params=greedy(4))  # warm-up
    transformers_run(model, prompts[:4], [4] * 4, pad_id)
    ours, theirs = [], []
    for _ in range(args.repeats):
        engine.flush_cache()
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=[greedy(n) for n in budgets])
        ours.append(total / (time.perf_counter() - start))
        assert [o["meta_info"]["completion_tokens"] for o in outs] == budgets
        torch.set_num_threads(threads)  # an in-process engine may have changed it
        theirs.append(total / transformers_run(model, prompts, budgets, pad_id))
    engine.shutdown()
    ours_tps, theirs_tps = statistics.median(ours), statistics.median(theirs)
    print(f"\n(b) {len(prompts)} requests ran, prompts 16-256 tokens, outputs 16-128 tokens "
          f"({total} in all), {args.dtype}, transformers on {threads} threads; "
          f"median of {args.repeats}")
    print(f"{'runtime':<34} {'output tok/s':>13}")
    print(f"{'radixlm (continuous, 1 call)':<34} {ours_tps:>13.1f}")
    print(f"{f'transformers (batches of {HF_BATCH})':<34} {theirs_tps:>13.1f}")
    print(f"{'ratio radixlm/transformers':<34} {ours_tps / theirs_tps:>12.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256,
                        help="requests in the radixlm vs transformers comparison")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--only", choices=["batching", "transformers"], default=None)
    args = parser.parse_args()
    path = default_model_path()
    threads = torch.get_num_threads()
    print(f"model {path}")
    if args.only in (None, "batching"):
        compare_batching(path, args, random.Random(args.seed))
    if args.only in (None, "transformers"):
        compare_with_transformers(path, args, random.Random(args.seed + 1), threads)


if __name__ == "__main__":
    main()
