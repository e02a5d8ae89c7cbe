"""CPU threads per forward pass: one, all, or chosen by measurement (the default), on a quiet
machine and beside a busy neighbour.

Three Engines on the default model, identical but for ``num_threads`` (1, all of torch's,
and None: the adaptive ``ThreadPolicy``), generate the same greedy batches in interleaved
rounds, so the ratios hold on a noisy machine. Then the same again while another process
spins on a core (a neighbour's job on a shared machine): a fixed thread count that uses
every core then waits for that core at every op, which is what the policy must notice.

    python benchmarks/bench_cpu_threads.py [--batches 1 4 16 64] [--tokens 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from machine import cpu_flags  # noqa: E402

import radixlm  # noqa: E402
from radixlm.models.default_model import default_model_path  # noqa: E402

PROMPTS = [f"Write a short note about topic number {i}: " for i in range(64)]


def _spin(stop) -> None:
    """A neighbour's CPU-bound job: busy until told to stop."""
    while not stop.is_set():
        sum(range(10_000))


def tokens_per_second(engine: radixlm.Engine, batch: int, tokens: int) -> float:
    params = {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    start = time.perf_counter()
    outputs = engine.generate(PROMPTS[:batch], params)
    elapsed = time.perf_counter() - start
    assert all(len(o["output_ids"]) == tokens for o in outputs)
    return batch * tokens / elapsed


def measure(engines: dict[str, radixlm.Engine], batches: list[int], tokens: int,
            repeats: int) -> dict[tuple[str, int], float]:
    """Median output tok/s per (engine, batch), rounds interleaved."""
    found: dict[tuple[str, int], list[float]] = {}
    for _ in range(repeats):
        for batch in batches:
            for name, engine in engines.items():
                found.setdefault((name, batch), []).append(
                    tokens_per_second(engine, batch, tokens))
    return {key: statistics.median(values) for key, values in found.items()}


def report(title: str, results: dict[tuple[str, int], float], batches: list[int]) -> None:
    print(f"\n{title}: output tok/s (median), and adaptive / best fixed")
    print(f"{'batch':>6} {'1 thread':>10} {'all':>10} {'adaptive':>10} {'ratio':>7}")
    for batch in batches:
        one, every, adaptive = (results[(name, batch)] for name in ("one", "all", "adaptive"))
        print(f"{batch:>6} {one:>10.1f} {every:>10.1f} {adaptive:>10.1f} "
              f"{adaptive / max(one, every):>7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    threads = torch.get_num_threads()
    print(f"cpu: {os.cpu_count()} cores, torch threads {threads}, flags {cpu_flags()}")
    path = str(default_model_path())
    common = {"dtype": args.dtype, "max_total_tokens": 8192}
    engines = {
        "one": radixlm.Engine(path, num_threads=1, **common),
        "all": radixlm.Engine(path, num_threads=threads, **common),
        "adaptive": radixlm.Engine(path, **common),
    }
    try:
        for engine in engines.values():  # warm-up, and the policy's first measurements
            for batch in args.batches:
                tokens_per_second(engine, batch, args.tokens)
        report("quiet", measure(engines, args.batches, args.tokens, args.repeats),
               args.batches)
        stop = multiprocessing.Event()
        neighbour = multiprocessing.Process(target=_spin, args=(stop,), daemon=True)
        neighbour.start()
        try:
            report("a neighbour spinning on one core",
                   measure(engines, args.batches, args.tokens, args.repeats), args.batches)
        finally:
            stop.set()
            neighbour.join()
    finally:
        for engine in engines.values():
            engine.shutdown()


if __name__ == "__main__":
    main()
