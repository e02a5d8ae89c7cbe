"""Speculative decoding (``speculative_algorithm="NGRAM"``) against plain decoding, and
llama.cpp's prompt-lookup decoding against its own plain decoding, side by side in one run
on the default model.

Workloads (``speculative_workloads.py``, deterministic, in the model's chat template):
- ``quote_doc``: quote or summarise a given passage (stdlib module docstrings);
- ``edit_code``: rename a parameter in a given 30-60-line stdlib function, reply with the code;
- ``extract_json``: fill a JSON object from a given support note;
- ``tool_chat``: a multi-turn chat whose tool message holds a JSON list the user asks to
  have restated as a table;
- ``open_chat``: write a short story (open-ended: little to copy);
- ``regenerate``: the ``open_chat`` prompts asked a second time, the first answers still
  cached (what the radix-tree source is for). Every system asks them once unmeasured first.

Systems, each an Engine built once: ``plain``; ``tree`` (NGRAM, drafts from the radix tree
then the request's own tokens); ``own`` (NGRAM with ``speculative_ngram_disable_radix_tree``).
Both NGRAM engines run with ``speculative_disable_by_batch_size=64``, so batches of 16
speculate too (the default, 8, turns it off there). The prefix cache of every engine is
flushed before every measured call, so no run drafts from an earlier round's outputs.

Timing: every call streams; prefill is the time until every request of the call has its
first token, decode the rest (its tokens: those that arrived after that). Batch 1 runs the
workload's first two prompts one call at a time; batch B runs its first B prompts in one
call. Round r runs every workload and batch on every system (in reverse order on odd
rounds) before round r + 1; medians over rounds of per-round ratios are printed. Greedy
outputs of the NGRAM engines are compared with ``plain``'s, request by request.

llama.cpp (``--gguf``, a GGUF of the same weights: llama.cpp's ``convert_hf_to_gguf.py``)
runs in a child process without torch (this file, ``--llama-worker``), batch 1 on the same
prompt ids, greedy: ``Llama`` without a draft model and with
``LlamaPromptLookupDecoding(num_pred_tokens=k)`` for each ``--llama-pred-tokens`` k.

Extra tables: the batch size where speculation stops paying (``--crossover-workloads``,
batches 1, 2, 4, 8, 16, tree engine); ``speculative_num_draft_tokens`` (SGLang's count: the
last token included, default 5) 3 and 9 at batch 1
(``--draft-workload``); with ``--float32``, batch 1 in float32.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_speculative.py [--quick]
        [--rounds 3] [--new-tokens 128] [--float32] [--json out.json]
        [--gguf smol-f16.gguf [--llama-threads 2] [--llama-pred-tokens 2 10] [--llama-only]]
"""
# ruff: noqa: I001 - radixlm is imported before torch (machine.py), for the reason given there

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from speculative_workloads import workloads

SYSTEMS = ("plain", "tree", "own")
CROSSOVER_BATCHES = (2, 8)
"""Batches run only for the crossover table (1, 4 and 16 come from the main one)."""
DEFAULT_DRAFT_TOKENS = 5
"""``speculative_num_draft_tokens``' default for NGRAM (radixlm/runtime/speculative/options.py)."""
STATS = ("spec_verify_steps", "spec_drafted_requests", "spec_draft_tokens",
         "spec_accepted_tokens")


# radixlm -------------------------------------------------------------------------------


def timed_call(engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """One streamed call: its outputs, prefill and decode seconds, decode tokens."""
    params = {"max_new_tokens": new_tokens, "temperature": 0.0}
    start = time.perf_counter()
    counts, outputs, decode_start, decode_from = [0] * len(prompts), [[]] * len(prompts), None, 0
    started: set[int] = set()
    for chunk in engine.generate(input_ids=prompts, sampling_params=params, stream=True):
        now, i = time.perf_counter(), chunk["index"]
        counts[i], outputs[i] = chunk["meta_info"]["completion_tokens"], chunk["output_ids"]
        if i not in started:
            started.add(i)
            if len(started) == len(prompts):
                decode_start, decode_from = now, sum(counts)
    end = time.perf_counter()
    return {"outputs": outputs, "prefill_s": decode_start - start,
            "decode_s": end - decode_start, "decode_tokens": sum(counts) - decode_from,
            "e2e_s": end - start}


def spec_stats(engine) -> dict[str, int]:
    stats = engine.get_server_info()["stats"]
    return {name: stats.get(name, 0) for name in STATS}


def measure(engine, batches: list[list[list[int]]], new_tokens: int, regenerate: bool) -> dict:
    """Runs ``batches`` (one call each) on a flushed cache; with ``regenerate`` each batch is
    asked once unmeasured first. Sums the calls' times and tokens; the spec stats' delta."""
    assert engine.flush_cache(), "flush_cache refused (requests in flight?)"
    if regenerate:
        for batch in batches:
            engine.generate(input_ids=batch, sampling_params={
                "max_new_tokens": new_tokens, "temperature": 0.0})
    before = spec_stats(engine)
    calls = [timed_call(engine, batch, new_tokens) for batch in batches]
    after = spec_stats(engine)
    total = {key: sum(c[key] for c in calls)
             for key in ("prefill_s", "decode_s", "decode_tokens", "e2e_s")}
    total["outputs"] = [out for c in calls for out in c["outputs"]]
    total["stats"] = {k: after[k] - before[k] for k in STATS}
    return total


# llama.cpp -----------------------------------------------------------------------------


def llama_worker(gguf: str, pred_tokens: list[int], threads: int) -> None:
    """Lines of JSON ``{"system", "prompt", "new_tokens"}`` in, one JSON result out each."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    def load(draft=None):
        # logits_all with a draft model: llama-cpp-python 0.3.36 turns it on itself but sizes
        # its score rows by the argument (n_batch rows without it), so a prompt and output
        # longer than n_batch fail ("could not broadcast ... into shape (0,)").
        # n_threads_batch too: its default (every core) would run the verify passes, but
        # not the plain decode steps, on more threads.
        return Llama(gguf, n_ctx=2048, n_batch=512, n_threads=threads, n_threads_batch=threads,
                     verbose=False, draft_model=draft, logits_all=draft is not None)

    models = {"plain": load()}
    for k in pred_tokens:
        models[f"lookup{k}"] = load(LlamaPromptLookupDecoding(num_pred_tokens=k))
    eos = models["plain"].token_eos()
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        llm = models[request["system"]]
        llm.reset()
        out: list[int] = []
        start = time.perf_counter()
        first = start
        stream = llm.generate(request["prompt"], temp=0.0, repeat_penalty=1.0, reset=True)
        for token in stream:
            if not out:
                first = time.perf_counter()
            out.append(int(token))
            if token == eos or len(out) >= request["new_tokens"]:
                break
        stream.close()
        end = time.perf_counter()
        print(json.dumps({"outputs": [out], "prefill_s": first - start,
                          "decode_s": end - first, "decode_tokens": len(out) - 1,
                          "e2e_s": end - start}), flush=True)


class LlamaCpp:
    """The worker above in a child process, with llama.cpp's OpenMP threads free to spin
    (as ``bench_generation.py`` runs it) and no torch."""

    def __init__(self, gguf: str, pred_tokens: list[int], threads: int):
        env = {k: v for k, v in os.environ.items()
               if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        self.systems = ["plain", *(f"lookup{k}" for k in pred_tokens)]
        self.child = subprocess.Popen(
            [sys.executable, __file__, "--llama-worker", gguf,
             "--llama-threads", str(threads), "--llama-pred-tokens", *map(str, pred_tokens)],
            env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        if self.child.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the llama.cpp worker exited with code {self.child.wait()}")

    def measure(self, system: str, prompts: list[list[int]], new_tokens: int) -> dict:
        calls = []
        for prompt in prompts:
            self.child.stdin.write(json.dumps({"system": system, "prompt": prompt,
                                               "new_tokens": new_tokens}) + "\n")
            self.child.stdin.flush()
            calls.append(json.loads(self.child.stdout.readline()))
        total = {key: sum(c[key] for c in calls)
                 for key in ("prefill_s", "decode_s", "decode_tokens", "e2e_s")}
        total["outputs"] = [c["outputs"][0] for c in calls]
        return total

    def close(self) -> None:
        self.child.stdin.close()
        self.child.wait()


# The run -------------------------------------------------------------------------------


def build_engines(args, path: str) -> dict:
    import radixlm

    ngram = {"speculative_algorithm": "NGRAM", "speculative_disable_by_batch_size": 64}
    tokens = {"max_total_tokens": 32768}
    options = {"plain": tokens, "tree": {**tokens, **ngram},
               "own": {**tokens, **ngram, "speculative_ngram_disable_radix_tree": True}}
    for k in args.draft_tokens:
        options[f"tree k={k}"] = {**ngram, "speculative_num_draft_tokens": k,
                                  "max_total_tokens": 8192}
    for breadth in args.bfs_breadths:
        options[f"tree bfs={breadth}"] = {
            **tokens, **ngram, "speculative_ngram_max_bfs_breadth": breadth,
            "speculative_num_draft_tokens": args.bfs_draft_tokens}
    if args.float32:
        options["float32 plain"] = {"dtype": "float32", "max_total_tokens": 8192}
        options["float32 tree"] = {**ngram, "dtype": "float32", "max_total_tokens": 8192}
    return {name: radixlm.Engine(path, **kw) for name, kw in options.items()}


def plan(args, names: list[str]) -> list[tuple[str, int, list[str]]]:
    """(workload, batch, systems) of one round."""
    steps = []
    for workload in names:
        for batch in sorted({*args.batches, *(CROSSOVER_BATCHES if workload in
                                              args.crossover_workloads else ())}):
            systems = list(SYSTEMS) if batch in args.batches else ["plain", "tree"]
            if batch in args.batches:
                systems += [f"tree bfs={b}" for b in args.bfs_breadths]
            if args.llama_only:
                systems = []
            if batch == 1:
                if workload == args.draft_workload and not args.llama_only:
                    systems += [f"tree k={k}" for k in args.draft_tokens]
                if args.float32 and not args.llama_only:
                    systems += ["float32 plain", "float32 tree"]
                if args.gguf and workload != "regenerate":
                    systems += ["llama.cpp plain",
                                *(f"llama.cpp lookup{k}" for k in args.llama_pred_tokens)]
            if systems:
                steps.append((workload, batch, systems))
    return steps


def run_round(engines, llama, prompts, steps, new_tokens: int, order: int,
              records: list | None, round_no: int) -> None:
    for workload, batch, systems in steps:
        chosen = prompts[workload][: max(batch, BATCH1_PROMPTS if batch == 1 else batch)]
        calls = [[p] for p in chosen] if batch == 1 else [chosen]
        for system in (systems if order % 2 == 0 else systems[::-1]):
            if system.startswith("llama.cpp"):
                result = llama.measure(system.split()[1], chosen, new_tokens)
            else:
                result = measure(engines[system], calls, new_tokens, workload == "regenerate")
            if records is not None:
                records.append({"round": round_no, "workload": workload, "batch": batch,
                                "system": system, **result})


BATCH1_PROMPTS = 2
"""Prompts a batch-1 measurement runs, one call each."""


def reference(system: str) -> str:
    return ("llama.cpp plain" if system.startswith("llama.cpp")
            else "float32 plain" if system.startswith("float32") else "plain")


def summarise(records: list[dict]) -> dict:
    """Per (workload, batch, system): median decode rate, median per-round decode and e2e
    speedups against its reference, accepted length over all rounds, and output mismatches
    against the reference (round 0)."""
    by_key: dict[tuple, dict[int, dict]] = {}
    for r in records:
        by_key.setdefault((r["workload"], r["batch"], r["system"]), {})[r["round"]] = r
    summary = {}
    for (workload, batch, system), rounds in by_key.items():
        ref = by_key.get((workload, batch, reference(system)), {})
        common = sorted(set(rounds) & set(ref))
        rate = [rounds[i]["decode_tokens"] / rounds[i]["decode_s"] for i in rounds]
        speed = [(rounds[i]["decode_tokens"] / rounds[i]["decode_s"])
                 / (ref[i]["decode_tokens"] / ref[i]["decode_s"]) for i in common]
        e2e = [(ref[i]["e2e_s"] / sum(map(len, ref[i]["outputs"])))
               / (rounds[i]["e2e_s"] / sum(map(len, rounds[i]["outputs"]))) for i in common]
        drafted = sum(r.get("stats", {}).get("spec_drafted_requests", 0) for r in rounds.values())
        accepted = sum(r.get("stats", {}).get("spec_accepted_tokens", 0) for r in rounds.values())
        first = min(common) if common else None
        mismatches = (None if first is None else
                      sum(a != b for a, b in zip(rounds[first]["outputs"], ref[first]["outputs"])))
        summary[(workload, batch, system)] = {
            "rate": statistics.median(rate), "speedup": statistics.median(speed) if speed else None,
            "e2e": statistics.median(e2e) if e2e else None,
            "accept": 1 + accepted / drafted if drafted else None, "mismatches": mismatches,
            "requests": len(rounds[first]["outputs"]) if first is not None else 0}
    return summary


def fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def tables(summary: dict, args, names: list[str]) -> str:
    def get(workload, batch, system):
        return summary.get((workload, batch, system), {})

    def mism(s):
        return "-" if s.get("mismatches") is None else f"{s['mismatches']}/{s['requests']}"

    lines = ["### Decode speedup against plain decoding (same engine options otherwise)", "",
             "| workload | batch | plain decode tok/s | tree: decode speedup | e2e | accepted "
             "length | mismatches | own tokens only: decode speedup | e2e | accepted length "
             "| mismatches |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for workload in names:
        for batch in args.batches:
            p, t, o = (get(workload, batch, s) for s in SYSTEMS)
            if not p:
                continue
            lines.append(
                f"| {workload} | {batch} | {fmt(p.get('rate'), '.1f')} | "
                f"{fmt(t.get('speedup'), '.2f', 'x')} | {fmt(t.get('e2e'), '.2f', 'x')} | "
                f"{fmt(t.get('accept'))} | {mism(t)} | {fmt(o.get('speedup'), '.2f', 'x')} | "
                f"{fmt(o.get('e2e'), '.2f', 'x')} | {fmt(o.get('accept'))} | {mism(o)} |")
    if args.gguf:
        llama = [f"llama.cpp lookup{k}" for k in args.llama_pred_tokens]
        lines += ["", "### Batch 1 against llama.cpp's prompt-lookup decoding (same prompts, "
                  "same weights: F16 GGUF)", "",
                  "| workload | radixlm plain tok/s | radixlm tree | radixlm own tokens | "
                  "llama.cpp plain tok/s | " + " | ".join(
                      f"llama.cpp lookup k={k}" for k in args.llama_pred_tokens)
                  + " | llama.cpp lookup mismatches |",
                  "|---" * (5 + len(llama)) + "|---|"]
        for workload in names:
            lp = get(workload, 1, "llama.cpp plain")
            if not lp:
                continue
            ours = [get(workload, 1, s) for s in SYSTEMS]
            theirs = [get(workload, 1, s) for s in llama]
            lines.append(
                f"| {workload} | {fmt(ours[0].get('rate'), '.1f')} | "
                f"{fmt(ours[1].get('speedup'), '.2f', 'x')} | "
                f"{fmt(ours[2].get('speedup'), '.2f', 'x')} | {fmt(lp['rate'], '.1f')} | "
                + " | ".join(fmt(s.get("speedup"), ".2f", "x") for s in theirs)
                + " | " + ", ".join(mism(s) for s in theirs) + " |")
    batches = sorted({*args.batches, *CROSSOVER_BATCHES})
    lines += ["", "### Where speculation stops paying (tree engine, "
              "speculative_disable_by_batch_size=64): decode speedup (accepted length)", "",
              "| workload | " + " | ".join(f"batch {b}" for b in batches) + " |",
              "|---" * (1 + len(batches)) + "|"]
    for workload in args.crossover_workloads:
        cells = []
        for b in batches:
            s = get(workload, b, "tree")
            cells.append("-" if not s else
                         f"{fmt(s.get('speedup'), '.2f', 'x')} ({fmt(s.get('accept'))})")
        lines.append(f"| {workload} | " + " | ".join(cells) + " |")
    lines += ["", f"### speculative_num_draft_tokens at batch 1 ({args.draft_workload}, tree "
              "engine)", "", "| draft tokens | decode speedup | accepted length | mismatches |",
              "|---|---|---|---|"]
    for k, system in sorted([(DEFAULT_DRAFT_TOKENS, "tree"),
                             *((k, f"tree k={k}") for k in args.draft_tokens)]):
        s = get(args.draft_workload, 1, system)
        lines.append(f"| {k} | {fmt(s.get('speedup'), '.2f', 'x')} | {fmt(s.get('accept'))} "
                     f"| {mism(s) if s else '-'} |")
    if args.bfs_breadths:
        trees = [f"tree bfs={b}" for b in args.bfs_breadths]
        lines += ["", f"### Token trees (speculative_num_draft_tokens={args.bfs_draft_tokens}) "
                  "against chains: decode speedup (accepted length)", "",
                  "| workload | batch | chains | " + " | ".join(trees) + " |",
                  "|---" * (3 + len(trees)) + "|"]
        for workload in names:
            for b in args.batches:
                row = [get(workload, b, system) for system in ("tree", *trees)]
                if any(row):
                    lines.append(f"| {workload} | {b} | " + " | ".join(
                        f"{fmt(r.get('speedup'), '.2f', 'x')} ({fmt(r.get('accept'))})"
                        for r in row) + " |")
    if args.float32:
        lines += ["", "### Batch 1 in float32", "",
                  "| workload | plain decode tok/s | tree: decode speedup | accepted length "
                  "| mismatches |", "|---|---|---|---|---|"]
        for workload in names:
            p, t = get(workload, 1, "float32 plain"), get(workload, 1, "float32 tree")
            if p:
                lines.append(f"| {workload} | {fmt(p['rate'], '.1f')} | "
                             f"{fmt(t.get('speedup'), '.2f', 'x')} | {fmt(t.get('accept'))} "
                             f"| {mism(t)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="one round, batches 1 and 4, 48 new tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--workloads", nargs="+", default=None)
    parser.add_argument("--crossover-workloads", nargs="*", default=["quote_doc", "open_chat"])
    parser.add_argument("--draft-workload", default="quote_doc")
    parser.add_argument("--draft-tokens", type=int, nargs="*", default=[3, 9],
                        help="speculative_num_draft_tokens besides the default, at batch 1")
    parser.add_argument("--bfs-breadths", type=int, nargs="*", default=[4],
                        help="speculative_ngram_max_bfs_breadth of token-tree systems")
    parser.add_argument("--bfs-draft-tokens", type=int, default=9,
                        help="speculative_num_draft_tokens of the token-tree systems")
    parser.add_argument("--float32", action="store_true", help="batch 1 in float32 too")
    parser.add_argument("--gguf", default=None, help="a GGUF of the default model (llama.cpp)")
    parser.add_argument("--llama-pred-tokens", type=int, nargs="+", default=[2, 10],
                        help="LlamaPromptLookupDecoding num_pred_tokens to run")
    parser.add_argument("--llama-threads", type=int, default=os.cpu_count(),
                        help="llama.cpp's threads (default: every core)")
    parser.add_argument("--llama-only", action="store_true",
                        help="run llama.cpp's systems only (batch 1), e.g. with other threads")
    parser.add_argument("--json", default=None, help="write the raw records here")
    parser.add_argument("--llama-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.llama_worker:
        llama_worker(args.llama_worker, args.llama_pred_tokens, args.llama_threads)
        return
    if args.quick:
        args.rounds, args.new_tokens, args.batches = 1, 48, [1, 4]

    import radixlm  # (before torch, which machine.py imports: radixlm sets the OpenMP wait)
    from machine import describe_machine

    from radixlm.models.default_model import default_model_path

    path = str(default_model_path())
    if args.llama_only:
        from transformers import AutoTokenizer

        args.batches, args.crossover_workloads = [1], []
        engines, tokenizer, info = {}, AutoTokenizer.from_pretrained(path), {}
    else:
        engines = build_engines(args, path)
        tokenizer, info = engines["plain"].tokenizer, engines["plain"].get_server_info()
    llama = (LlamaCpp(args.gguf, args.llama_pred_tokens, args.llama_threads) if args.gguf
             else None)
    chats = workloads(max(*args.batches, BATCH1_PROMPTS))
    names = args.workloads or list(chats)
    prompts = {name: [tokenizer.encode(  # the text Engine.apply_chat_template makes
        tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False) for chat in chats[name]] for name in names}
    print(f"# bench_speculative.py, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"{describe_machine()}; radixlm from {Path(radixlm.__file__).parent}; model "
          f"{Path(path).name}, dtype {info.get('dtype', 'auto')}; {args.rounds} rounds, "
          f"{args.new_tokens} new tokens, greedy")
    print("prompt tokens: " + ", ".join(
        f"{n} {min(map(len, p))}-{max(map(len, p))}" for n, p in prompts.items()), flush=True)
    steps = plan(args, names)
    records: list[dict] = []
    try:
        run_round(engines, llama, prompts, steps, max(16, args.new_tokens // 5), 0, None, -1)
        for round_no in range(args.rounds):
            started = time.perf_counter()
            run_round(engines, llama, prompts, steps, args.new_tokens, round_no, records,
                      round_no)
            print(f"\n## after round {round_no + 1} ({time.perf_counter() - started:.0f} s)\n")
            print(tables(summarise(records), args, names), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(records))
    finally:
        if llama:
            llama.close()
        for engine in engines.values():
            engine.shutdown()


if __name__ == "__main__":
    main()
