"""Structured generation on the default model: the token mask's cost, and what constraints
and jump-forward do to end-to-end throughput.

(a) Mask overhead per token on the default model's 49,152-token vocabulary: for each of the
    corpus's 50 JSON schemas and 20 regexes (tests/grammar_corpus.py), a matcher walks a
    seeded random path through its grammar (each step a token its mask allows), and every
    step's mask fill plus its application to a (1, 49152) float32 logits row is timed.
    Reported: mean and p99 in microseconds (the aim: under 50 us and 0.5 ms).
(b) End-to-end throughput, side by side in one run: the 50 JSON-schema prompts as one
    ``generate`` call at temperature 0 on two engines, one with jump-forward and one
    without, and the same prompts unconstrained (``ignore_eos``, each with exactly the
    token count its constrained output had). Throughput is output tokens over wall time;
    the runs alternate over ``--repeats`` rounds (after a warm-up round that caches the
    prompts on both engines) and each figure is the median. Reported as ratios to the
    unconstrained run, with the decode steps each run took.

    python benchmarks/bench_grammar.py [--repeats 3] [--walk 64] [--dtype float32]
"""

# ruff: noqa: I001 - radixlm is imported before torch, for the reason given there

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

# First: importing radixlm sets its OpenMP wait (radixlm/__init__.py), which must precede
# torch's loading to apply to this process (transformers included) and its servers.
import radixlm  # noqa: E402

import torch  # noqa: E402
from grammar_corpus import JSON_SCHEMAS, MAX_NEW_TOKENS, REGEXES, json_prompt  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from radixlm.models.default_model import default_model_path  # noqa: E402
from radixlm.models.model_config import ModelConfig  # noqa: E402
from radixlm.runtime.grammar.grammar_backend import GrammarKey  # noqa: E402
from radixlm.runtime.grammar.xgrammar_backend import XGrammarBackend  # noqa: E402

VOCAB_NOTE = "the default model's 49,152-token vocabulary, 1 thread"


def constraints() -> list[GrammarKey]:
    return ([GrammarKey("json_schema", json.dumps(schema)) for _, schema in JSON_SCHEMAS]
            + [GrammarKey("regex", regex) for _, regex in REGEXES])


def mask_overhead(walk: int) -> dict[str, list[float]]:
    """Seconds per token of the mask's fill, its application, and both, over every step of
    every walk."""
    path = default_model_path()
    config = ModelConfig.from_path(path)
    backend = XGrammarBackend(AutoTokenizer.from_pretrained(path), config.vocab_size,
                              config.eos_token_ids)
    futures = [backend.compile(key) for key in constraints()]
    rng = random.Random(0)
    logits = torch.zeros(1, config.vocab_size)
    bitmask = backend.bitmask(1)
    times: dict[str, list[float]] = {"fill": [], "apply": [], "fill + apply": []}
    for future in futures:
        matcher = backend.new_matcher(future.result())
        for _ in range(walk):
            logits.zero_()
            start = time.perf_counter()
            matcher.fill_bitmask(bitmask, 0)
            filled = time.perf_counter()
            backend.apply_bitmask(logits, bitmask, [0])
            end = time.perf_counter()
            times["fill"].append(filled - start)
            times["apply"].append(end - filled)
            times["fill + apply"].append(end - start)
            allowed = torch.nonzero(logits[0] == 0).flatten().tolist()
            token = rng.choice(allowed)
            assert matcher.accept_token(token)
            if matcher.is_terminated():
                break
    backend.shutdown()
    return times


def run(engine, prompts, params) -> tuple[float, int, list[dict]]:
    """(seconds, decode steps, outputs) of one generate call."""
    steps = engine.get_server_info()["stats"]["decode_steps"]
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    return seconds, engine.get_server_info()["stats"]["decode_steps"] - steps, outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--walk", type=int, default=64, help="most steps of each mask walk")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    torch.set_num_threads(1)  # as the scheduler runs small batches
    print(f"(a) mask per token, {VOCAB_NOTE}, {len(constraints())} constraints "
          f"(microseconds)")
    for name, values in mask_overhead(args.walk).items():
        values = sorted(values)
        p99 = values[int(0.99 * (len(values) - 1))]
        print(f"{name:<14} mean {statistics.fmean(values) * 1e6:8.1f}   p99 {p99 * 1e6:8.1f}"
              f"   steps {len(values)}")
    torch.set_num_threads(os.cpu_count() or 1)

    options = {"dtype": args.dtype, "max_total_tokens": 65536}
    with radixlm.Engine(**options) as jumping, \
            radixlm.Engine(disable_jump_forward=True, **options) as plain:
        prompts = [jumping.apply_chat_template([{"role": "user", "content": json_prompt(w)}])
                   for w, _ in JSON_SCHEMAS]
        params = [{"json_schema": json.dumps(s), "temperature": 0.0,
                   "max_new_tokens": MAX_NEW_TOKENS} for _, s in JSON_SCHEMAS]
        _, _, reference = run(plain, prompts, params)  # warm-up; fixes the token counts
        run(jumping, prompts, params)  # warm-up: both engines start with the prompts cached
        counts = [len(out["output_ids"]) for out in reference]
        free = [{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True} for n in counts]
        rates: dict[str, list[float]] = {"unconstrained": [], "constrained": [],
                                         "constrained + jump-forward": []}
        steps: dict[str, int] = {}
        for _ in range(args.repeats):
            for name, engine, request in (("unconstrained", plain, free),
                                          ("constrained", plain, params),
                                          ("constrained + jump-forward", jumping, params)):
                seconds, decode_steps, outs = run(engine, prompts, request)
                tokens = sum(len(out["output_ids"]) for out in outs)
                rates[name].append(tokens / seconds)
                steps[name] = decode_steps
    base = statistics.median(rates["unconstrained"])
    print(f"\n(b) {len(prompts)} JSON-schema prompts in one call, {sum(counts)} output tokens "
          f"without jump-forward, {args.repeats} rounds, median of each")
    print(f"{'run':<28} {'tok/s':>8} {'vs unconstrained':>17} {'decode steps':>13}")
    for name, values in rates.items():
        rate = statistics.median(values)
        print(f"{name:<28} {rate:>8.1f} {rate / base:>16.2f}x {steps[name]:>13}")


if __name__ == "__main__":
    main()
