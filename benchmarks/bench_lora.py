"""Many LoRA adapters in one batch (issue 61), side by side in one run on the default model:
requests spread over 1, 4, 16 and 64 adapters against the base model alone and against
merging each adapter into the weights and serving it on its own Engine.

Workload (``lora_workloads.py``): ``--requests`` short distinct chat prompts (tens of
tokens), ``--new-tokens`` greedy tokens each with ``ignore_eos``, so decode dominates; all
requests of a system are sent at once, as one ``generate`` call (the engine runs up to
``max_running_requests`` = 64 of them at a time). Adapters: ``--adapters`` PEFT LoRA
adapters of rank ``--rank`` on q/k/v/o/gate/up/down with random A and B
(``init_lora_weights=False``, B scaled by ``--b-scale``), written to a temporary directory
before anything is timed.

Systems:
- ``base``: a plain Engine (no LoRA), the same other options;
- ``lora-N`` (N in ``--counts``): one Engine with every adapter registered,
  ``max_loras_per_batch=16``; request i uses adapter ``a{i % N}``; ``lora-0``: the same
  Engine, no request names an adapter (what the LoRA engine costs when unused);
  ``lora-N grouped`` (N in ``--grouped``): the same N adapters, but each batch of 64
  requests gives each adapter consecutive requests (N segments of rows, not one a row);
  ``lora-1 tiny``: every request on one rank-1 adapter of o_proj alone (what a pass with
  adapter rows costs beyond their low-rank arithmetic);
- ``merged``: for each of the first ``--merged`` adapters of the ``--merged-of``-adapter
  spread, the adapter merged into the base weights (PEFT ``merge_and_unload``, a float32
  model directory like the base checkpoint, written untimed), an Engine started on it,
  one 4-token request to warm it (counted as start-up), its share of requests served
  (request i with i % merged_of == a), the Engine shut down (counted as start-up).
  Throughput is given with and without the start-ups; with fewer merged engines than
  adapters, per-adapter figures are extrapolated (the ratio is per adapter anyway).

Round r runs base and every lora-N (reverse order on odd rounds); medians over rounds of
per-round ratios against ``base``. The merged systems run once, after the rounds, then
``base`` once more (its rate is printed as a drift check). Outputs: each ``lora-N`` against
``base`` (they should differ), each pair of systems on the requests they give the same
adapter (they should not; bfloat16 near-ties may flip), and a few requests against PEFT's
own greedy generation in float32 (transformers).

Rates are given by the wall clock and by the CPU time of the engine's scheduler process
(psutil), which moves less when other work shares the cores.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_lora.py [--quick] [--rounds 1]
        [--requests 256] [--new-tokens 32] [--merged 4] [--float32] [--all-threads]
        [--schedule-policy fcfs] [--json out.json]

(Defaults take 3-5 minutes on 2 cores, most of it the mixed-adapter systems; a merged Engine
takes 8-60 s to start there, by load, so 4 of the 16 run and the rest are extrapolated.)
"""
# ruff: noqa: I001 - radixlm is imported before torch (machine.py), for the reason given there

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lora_workloads import chat_prompts, load_base, write_adapters, write_merged

PEFT_CHECKS = 4
"""Requests of ``lora-4`` (adapters a0-a3) checked against PEFT's generation."""


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "uptime unavailable"


TINY, TINY_ADAPTER = "lora-1 tiny", "tiny"
"""A system whose every request uses one rank-1 adapter of ``o_proj`` alone: the cost of a
pass with adapter rows with next to no low-rank arithmetic."""
BATCH = 64
"""``max_running_requests``' default: the requests one decode batch holds."""


def git_state(package: Path) -> str:
    """The checkout's commit and its changed files under ``radixlm/`` (others edit it)."""
    try:
        run = {"capture_output": True, "text": True, "cwd": package, "check": True}
        head = subprocess.run(["git", "log", "-1", "--format=%h %cd", "--date=iso"],
                              **run).stdout.strip()
        dirty = subprocess.run(["git", "status", "--short", "."], **run).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"
    changed = [line.strip() for line in dirty if line.strip()]
    return f"commit {head}; changed under radixlm/: {', '.join(changed) or 'none'}"


def adapter_of(i: int, count: int, grouped: bool = False) -> str | None:
    """Request i's adapter: round-robin over ``count`` (None for 0); ``grouped``: each run of
    ``BATCH`` requests (one batch) takes the same ``count`` adapters, each for consecutive
    requests, so a batch's rows come in ``count`` segments rather than one per row."""
    if count == 0:
        return None
    return f"a{(i % BATCH) * count // BATCH}" if grouped else f"a{i % count}"


def assignment(system: str, n: int) -> list[str | None] | None:
    """The adapters of ``system``'s n requests (None: the base engine)."""
    if system == "base":
        return None
    if system == TINY:
        return [TINY_ADAPTER] * n
    count = int(system.split()[0].split("-")[1])
    return [adapter_of(i, count, system.endswith("grouped")) for i in range(n)]


def start_engine(path: str, **options):
    """An Engine and its scheduler process (psutil), whose CPU time a call is charged:
    less sensitive than the wall clock to other work sharing the cores."""
    import psutil
    import radixlm

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    engine = radixlm.Engine(path, **options)
    scheduler = next(p for p in psutil.Process().children(recursive=True)
                     if p.pid not in before and "scheduler" in " ".join(p.cmdline()))
    return engine, scheduler


def cpu_seconds(process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def serve(engine, scheduler, prompts: list[list[int]], new_tokens: int,
          adapters: list | None) -> dict:
    """One non-streamed call of every prompt, from an empty prefix cache (every system
    computes its prompts: the base engine's cache would otherwise keep its prompts from round
    to round, while the adapters sharing the LoRA engine evict each other's): its outputs,
    wall seconds, the scheduler's CPU seconds and output tokens."""
    params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    extra = {} if adapters is None else {"lora_path": adapters}
    if not engine.flush_cache():
        raise RuntimeError("the engine did not flush its prefix cache")
    cpu = cpu_seconds(scheduler)
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params, **extra)
    seconds = time.perf_counter() - start
    return {"outputs": [o["output_ids"] for o in outs], "seconds": seconds,
            "cpu_s": cpu_seconds(scheduler) - cpu,
            "tokens": sum(o["meta_info"]["completion_tokens"] for o in outs),
            "requests": len(prompts)}


def run_merged(args, path: str, adapters: dict[str, Path], prompts, work: Path,
               options: dict) -> dict:
    """The merged-one-at-a-time system: see the module docstring."""
    import torch

    share = {a: [i for i in range(len(prompts)) if i % args.merged_of == a]
             for a in range(args.merged)}
    per = []
    for a, rows in share.items():
        started = time.perf_counter()
        model_dir = write_merged(path, adapters[f"a{a}"], work / f"merged{a}", torch.float32)
        merge_s = time.perf_counter() - started
        started = time.perf_counter()
        engine, scheduler = start_engine(str(model_dir), **options)
        engine.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": 4})
        start_s = time.perf_counter() - started
        try:
            result = serve(engine, scheduler, [prompts[i] for i in rows], args.new_tokens,
                           None)
        finally:
            started = time.perf_counter()
            engine.shutdown()
            stop_s = time.perf_counter() - started
        for name in model_dir.iterdir():  # 0.5 GB each: keep one on disk at a time
            name.unlink()
        model_dir.rmdir()
        per.append({"adapter": a, "rows": rows, "merge_s": merge_s, "start_s": start_s,
                    "stop_s": stop_s, **result})
        print(f"  merged a{a}: merge {merge_s:.1f} s, start {start_s:.1f} s, serve "
              f"{result['seconds']:.1f} s, stop {stop_s:.1f} s", flush=True)
    return {"per_adapter": per}


def peft_reference(path: str, adapter: Path, prompt: list[int], new_tokens: int) -> list[int]:
    """PEFT's greedy tokens for ``prompt`` (float32, transformers), EOS taken like any token
    (as ``ignore_eos`` does; ``generate(min_new_tokens=...)`` would forbid it instead)."""
    import torch
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_base(path), str(adapter)).eval()
    out, ids = [], torch.tensor([prompt])
    past = None
    with torch.no_grad():
        for _ in range(new_tokens):
            step = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = step.past_key_values
            out.append(int(step.logits[0, -1].argmax()))
            ids = torch.tensor([[out[-1]]])
    return out


def same_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# Tables --------------------------------------------------------------------------------


def throughput_table(records: list[dict], merged: dict | None, args) -> tuple[str, dict]:
    """Rates per system (medians over rounds) and ratios against ``base`` (medians of
    per-round ratios): by the wall clock and by the scheduler process's CPU time."""
    by_system: dict[str, dict[int, dict]] = {}
    for r in records:
        by_system.setdefault(r["system"], {})[r["round"]] = r
    base = by_system["base"]
    lines = ["| system | adapters in the batch | output tok/s | requests/s | vs base | "
             "scheduler CPU ms a token | vs base by CPU time |",
             "|---|---|---|---|---|---|---|"]
    ratios = {}

    def per_token(r, key):
        return r[key] / r["tokens"]

    for system, rounds in by_system.items():
        rate = statistics.median(r["tokens"] / r["seconds"] for r in rounds.values())
        reqs = statistics.median(r["requests"] / r["seconds"] for r in rounds.values())
        cpu = statistics.median(per_token(r, "cpu_s") for r in rounds.values())
        common = [i for i in rounds if i in base]
        ratio = statistics.median(per_token(base[i], "seconds")
                                  / per_token(rounds[i], "seconds") for i in common)
        cpu_ratio = statistics.median(per_token(base[i], "cpu_s")
                                      / per_token(rounds[i], "cpu_s") for i in common)
        ratios[system], ratios[f"{system} by CPU"] = ratio, cpu_ratio
        count = ("-" if system == "base" else "1 (rank 1, o_proj only)" if system == TINY
                 else system.split()[0].split("-")[1]
                 + (" (in runs of consecutive rows)" if system.endswith("grouped") else ""))
        lines.append(f"| {system} | {count} | {rate:.1f} | {reqs:.2f} | {ratio:.2f}x | "
                     f"{1000 * cpu:.2f} | {cpu_ratio:.2f}x |")
    base_rate = statistics.median(r["tokens"] / r["seconds"] for r in base.values())
    base_cpu = statistics.median(per_token(r, "cpu_s") for r in base.values())
    if merged:
        per = merged["per_adapter"]
        tokens, reqs = sum(p["tokens"] for p in per), sum(p["requests"] for p in per)
        serve_s = sum(p["seconds"] for p in per)
        whole_s = serve_s + sum(p["start_s"] + p["stop_s"] for p in per)
        cpu = sum(p["cpu_s"] for p in per) / tokens
        for label, seconds in (("without start-up", serve_s), ("with start-up", whole_s)):
            rate = tokens / seconds
            ratios[f"merged {label}"] = rate / base_rate
            cpu_cells = (f"{1000 * cpu:.2f} | {base_cpu / cpu:.2f}x"
                         if label == "without start-up" else "- | -")
            lines.append(f"| merged, one at a time, {label} | 1 (of {args.merged_of}; "
                         f"{len(per)} run) | {rate:.1f} | {reqs / seconds:.2f} | "
                         f"{rate / base_rate:.2f}x | {cpu_cells} |")
        ratios["merged without start-up by CPU"] = base_cpu / cpu
    return "\n".join(lines), ratios


def merged_table(merged: dict) -> str:
    per = merged["per_adapter"]

    def med(key):
        return statistics.median(p[key] for p in per)

    return ("| merge + save (untimed) | Engine start + 4-token warm-up | serve its share | "
            "shutdown | requests a share |\n|---|---|---|---|---|\n"
            f"| {med('merge_s'):.1f} s | {med('start_s'):.1f} s | {med('seconds'):.1f} s | "
            f"{med('stop_s'):.1f} s | {per[0]['requests']} |  (medians over {len(per)} "
            "adapters)")


def output_checks(records: list[dict], merged: dict | None, merged_of: int) -> str:
    first = {r["system"]: r["outputs"] for r in records if r["round"] == 0}
    n = len(first["base"])
    lines = ["| system | differs from base | same adapter, other system: mismatches / "
             "compared | across rounds: mismatches |", "|---|---|---|---|"]
    systems = [s for s in first if s != "base"]
    for system in systems:
        mine = assignment(system, n)
        differs = sum(a != b for a, b in zip(first[system], first["base"]))
        pairs = []
        for other in [*systems, "base"]:
            theirs = assignment(other, n) or [None] * n
            rows = [i for i in range(n) if mine[i] == theirs[i]]
            if other == system or not rows:
                continue
            bad = sum(first[system][i] != first[other][i] for i in rows)
            pairs.append(f"{other} {bad}/{len(rows)}")
        rounds = [r["outputs"] for r in records if r["system"] == system and r["round"] > 0]
        drift = sum(sum(a != b for a, b in zip(o, first[system])) for o in rounds)
        lines.append(f"| {system} | {differs}/{n} | {', '.join(pairs) or '-'} | "
                     f"{drift if rounds else '-'} |")
    mixed = f"lora-{merged_of}"
    if merged and mixed in first:
        rows = [i for p in merged["per_adapter"] for i in p["rows"]]
        outs = [o for p in merged["per_adapter"] for o in p["outputs"]]
        bad = sum(first[mixed][i] != o for i, o in zip(rows, outs))
        differs = sum(first["base"][i] != o for i, o in zip(rows, outs))
        lines.append(f"| merged | {differs}/{len(rows)} | {mixed} {bad}/{len(rows)} | - |")
    return "\n".join(lines)


# The run -------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="one round, 64 requests, 32 new tokens, 2 merged engines")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--counts", type=int, nargs="+", default=[0, 1, 4, 16, 64],
                        help="adapters the requests are spread over (0: none named)")
    parser.add_argument("--grouped", type=int, nargs="*", default=[16],
                        help="spreads also run grouped: each adapter's requests consecutive")
    parser.add_argument("--tiny", action=argparse.BooleanOptionalAction, default=True,
                        help=f"run {TINY!r} (rank 1, o_proj: an adapter pass's own cost)")
    parser.add_argument("--adapters", type=int, default=64, help="adapters registered")
    parser.add_argument("--b-scale", type=float, default=0.1,
                        help="B's random entries scaled by this (lora_workloads.py)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=int, default=16)
    parser.add_argument("--max-loras-per-batch", type=int, default=16)
    parser.add_argument("--max-lora-rank", type=int, default=16)
    parser.add_argument("--merged-of", type=int, default=16,
                        help="the spread the merged system serves one adapter at a time")
    parser.add_argument("--merged", type=int, default=4,
                        help="merged engines actually run (the rest extrapolated); 0: none")
    parser.add_argument("--max-total-tokens", type=int, default=16384)
    parser.add_argument("--float32", action="store_true", help="dtype float32 (else auto)")
    parser.add_argument("--schedule-policy", default=None,
                        help="the engines' schedule_policy (default lpm orders a batch's rows "
                             "by cached prefix, not by arrival: fcfs keeps --grouped runs)")
    parser.add_argument("--all-threads", action="store_true",
                        help="disable_adaptive_timing: every pass on all threads (the "
                             "adaptive choice times LoRA and fused passes of a size together)")
    parser.add_argument("--json", default=None, help="write the raw records here")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.requests, args.new_tokens = 1, 64, 32
        args.merged = min(args.merged, 2)
    args.merged = min(args.merged, args.merged_of)

    import radixlm  # (before torch, which machine.py imports: radixlm sets the OpenMP wait)
    from machine import describe_machine

    from radixlm.models.default_model import default_model_path

    path = str(default_model_path())
    command = " ".join(["python benchmarks/bench_lora.py", *sys.argv[1:]])
    print(f"# bench_lora.py, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"command: {command}")
    print(f"load before: {uptime()}", flush=True)
    print(f"radixlm: {git_state(Path(radixlm.__file__).parent)}", flush=True)
    options = {"max_total_tokens": args.max_total_tokens}
    if args.float32:
        options["dtype"] = "float32"
    if args.all_threads:
        options["disable_adaptive_timing"] = True
    if args.schedule_policy:
        options["schedule_policy"] = args.schedule_policy
    with tempfile.TemporaryDirectory(prefix="bench_lora_") as tmp:
        work = Path(tmp)
        started = time.perf_counter()
        adapters = write_adapters(path, work, [f"a{i}" for i in range(args.adapters)],
                                  args.rank, args.alpha, b_scale=args.b_scale)
        print(f"{args.adapters} adapters (rank {args.rank}, alpha {args.alpha}, B scaled by "
              f"{args.b_scale}) written in {time.perf_counter() - started:.1f} s (untimed)",
              flush=True)
        adapters.update(write_adapters(path, work, [TINY_ADAPTER], 1, 1, ("o_proj",),
                                       args.b_scale, seed=999))
        started = time.perf_counter()
        engines = {"base": start_engine(path, **options)}
        print(f"base engine started in {time.perf_counter() - started:.1f} s", flush=True)
        started = time.perf_counter()
        engines["lora"] = start_engine(
            path, **options, lora_paths=[f"{n}={p}" for n, p in adapters.items()],
            max_loras_per_batch=args.max_loras_per_batch, max_lora_rank=args.max_lora_rank)
        print(f"LoRA engine started in {time.perf_counter() - started:.1f} s", flush=True)
        tokenizer, info = engines["base"][0].tokenizer, engines["base"][0].get_server_info()
        prompts = chat_prompts(tokenizer, args.requests)
        print(f"{describe_machine()}; radixlm from {Path(radixlm.__file__).parent}; model "
              f"{Path(path).name}, dtype {info.get('dtype', 'auto')}; {args.requests} requests "
              f"of {min(map(len, prompts))}-{max(map(len, prompts))} prompt tokens, "
              f"{args.new_tokens} new tokens, greedy, ignore_eos; {args.rounds} rounds",
              flush=True)
        names = ["base", *(f"lora-{c}" for c in args.counts), *([TINY] if args.tiny else []),
                 *(f"lora-{c} grouped" for c in args.grouped)]
        systems = [(name, "base" if name == "base" else "lora",
                    assignment(name, args.requests)) for name in names]
        records: list[dict] = []
        merged = None
        try:
            for _system, engine, lora in systems:  # warm-up: every path once, unmeasured
                serve(*engines[engine], prompts[:16], 8, None if lora is None else lora[:16])
            for round_no in range(args.rounds):
                for system, engine, lora in (systems if round_no % 2 == 0 else systems[::-1]):
                    result = serve(*engines[engine], prompts, args.new_tokens, lora)
                    records.append({"round": round_no, "system": system, **result})
                    print(f"  round {round_no} {system}: {result['seconds']:.1f} s", flush=True)
            if args.merged:
                merged = run_merged(args, path, adapters, prompts, work, options)
                after = serve(*engines["base"], prompts, args.new_tokens, None)
                print(f"  base after the merged engines: {after['seconds']:.1f} s", flush=True)
            stats = engines["lora"][0].get_server_info().get("lora")
            checks = []
            lora4 = next((r for r in records if r["system"] == "lora-4"), None)
            if lora4 is not None:
                for i in range(min(PEFT_CHECKS, args.requests)):
                    ref = peft_reference(path, adapters[f"a{i % 4}"], prompts[i],
                                         args.new_tokens)
                    checks.append(same_prefix(ref, lora4["outputs"][i]))
        finally:
            for engine, _ in engines.values():
                engine.shutdown()
    table, ratios = throughput_table(records, merged, args)
    print(f"\nload after: {uptime()}\n")
    print("### Throughput (one generate call of every request; e2e)\n")
    print(table)
    if merged:
        base_rate = statistics.median(r["tokens"] / r["seconds"] for r in records
                                      if r["system"] == "base")
        print(f"\nbase after the merged engines: {after['tokens'] / after['seconds']:.1f} "
              f"tok/s ({after['tokens'] / after['seconds'] / base_rate:.2f}x the rounds' "
              "median)")
        print(f"\n### Merged one at a time: per adapter\n\n{merged_table(merged)}")
        for label in ("without start-up", "with start-up", "without start-up by CPU"):
            mixed = f"lora-{args.merged_of}"
            if mixed in ratios:
                mine = ratios[f"{mixed} by CPU" if label.endswith("CPU") else mixed]
                print(f"{mixed} against merged {label}: "
                      f"{mine / ratios[f'merged {label}']:.2f}x")
    print(f"\n### Outputs\n\n{output_checks(records, merged, args.merged_of)}")
    if checks:
        print(f"\nlora-4 requests 0-{len(checks) - 1} (adapters a0-a{len(checks) - 1}) "
              f"against PEFT float32 greedy: tokens equal before the first difference "
              f"{checks} of {args.new_tokens}")
    print(f"\nLoRA engine's adapter stats: {stats}")
    if args.json:
        Path(args.json).write_text(json.dumps({"records": records, "merged": merged,
                                               "ratios": ratios, "peft": checks}))


if __name__ == "__main__":
    main()
