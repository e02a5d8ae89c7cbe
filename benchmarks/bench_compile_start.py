"""How much inductor's on-disk cache saves an ``enable_torch_compile`` start: the default
model's Engine started twice, each in a fresh process, on an empty compile cache and then on
the cache the first start left; and once without compiling, for scale.

Each start is timed from the Engine's construction to its first answer (the compile runs at
start, in the warm-up). Both starts run side by side in one run, so their ratio holds on a
shared machine; the absolute seconds are for context.

    python benchmarks/bench_compile_start.py [--dtype auto] [--max-bs 32]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

from machine import describe_machine

START = """
import sys, time
import radixlm
started = time.perf_counter()
options = dict(enable_torch_compile=sys.argv[2] == "1", torch_compile_max_bs=int(sys.argv[3]))
with radixlm.Engine(dtype=sys.argv[1], max_total_tokens=4096, **options) as engine:
    engine.generate("The capital of France is", {"max_new_tokens": 4, "temperature": 0})
    print(time.perf_counter() - started)
"""


def start_seconds(dtype: str, compiled: bool, max_bs: int, cache: str) -> float:
    """Seconds from constructing the Engine to its first answer, in a fresh process."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
    out = subprocess.run(
        [sys.executable, "-c", START, dtype, "1" if compiled else "0", str(max_bs)],
        env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-bs", type=int, default=32)
    args = parser.parse_args()
    print(describe_machine())
    with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
        eager = start_seconds(args.dtype, False, args.max_bs, cache)
        first = start_seconds(args.dtype, True, args.max_bs, cache)
        second = start_seconds(args.dtype, True, args.max_bs, cache)
    print(f"start without compiling  {eager:7.1f} s")
    print(f"first compiled start     {first:7.1f} s (empty cache)")
    print(f"second compiled start    {second:7.1f} s (the first's cache): "
          f"{first / second:.1f}x faster")


if __name__ == "__main__":
    main()
