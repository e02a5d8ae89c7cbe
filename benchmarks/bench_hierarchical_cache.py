"""The hierarchical prefix cache (``enable_hierarchical_cache``) against the radix cache
alone, side by side in one run on the default model, on a multi-turn workload whose working
set is several times the device pool (L1), and the first turn after a restart with the disk
tier (L3).

Workloads (``hierarchical_workloads.py``, deterministic), chosen by ``--workload``:
``chat`` (the default): ``--conversations`` conversations of ``--turns`` turns over a few
shared system prompts, questions of some tens of tokens. ``agent``: the issue's motivating
case, an agent that returns to the same long context every few minutes; ``--conversations``
sessions of ``--turns`` turns, each over one shared system prompt and its own document of
``--document-tokens`` tokens (a tool's output), every later turn a follow-up of at most 40
tokens. On the chat workload a call's new tokens are a large share of what the radix cache
alone prefills (it keeps the shared system prompts), which bounds what a slower tier can
save; on the agent workload they are a small share of a long per-session context, as in the
issue's case. In both, turn k + 1's prompt is turn k's prompt, its answer and a new
question, in the model's chat template. Requests go turn by turn, round-robin over the
conversations, ``--batch`` at a time (one call, streamed): a conversation comes back to its
context after all the others have pushed it out of L1.
Answers are greedy, ``--new-tokens`` long (``ignore_eos``). The first engine a request goes
to decides its answer, which the conversation's later prompts carry; every system is sent the
same prompts, in the same order, and its outputs are compared with those answers (bfloat16
may flip near-ties between a recomputed prefix and a cached one: mismatches are counted).

Systems, each its own Engine with the same ``max_total_tokens`` (L1), all running at once:
``radix`` (the radix cache only); ``L1+L2`` (a host tier large enough for the working set);
``L1+L2+L3`` (the same, and the file backend in a fresh temporary directory), all three
with the default write policy, ``write_back``; ``L1+L2+L3 write-through`` (the same with
``hicache_write_policy="write_through"``: every prefix goes to the host tier and the disk as
soon as it is cached, not when L1 evicts it, so the disk also holds what L1 never gave up).

Timing: every call goes to the engines one after the other (an idle engine waits without
using the CPU), in an order that rotates from call to call, so a change of the machine's
load (others share its cores) falls on every system alike. Time to first token (TTFT) is,
per request, the time from sending its call until its first streamed token; throughput is
requests (and output tokens) over the sum of the system's calls' wall times. Every engine
first answers a short unrelated prompt, unmeasured.

Restart: after the workload, every system is sent each conversation's next turn (a new
question after the last answer), in the same batches. ``radix`` and ``L1+L2`` answer it
without stopping (``L1+L2`` is the server that never stopped: the prefixes are in its L1 and
L2); the engines with a disk tier are shut down first and a new one started on the same
directory, so its L1 and L2 start empty and only the disk holds the conversations.

Each round starts fresh engines (and empty disk directories); medians over rounds of the
per-round figures and ratios are printed.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_hierarchical_cache.py [--quick]
        [--workload chat|agent] [--conversations 40 (agent: 24)] [--turns 8 (agent: 6)]
        [--document-tokens 1500] [--max-total-tokens 6144] [--rounds 1] [--json out]
"""
# ruff: noqa: I001 - radixlm is imported before torch (machine.py), for the reason given there

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import tempfile
import time

from hierarchical_workloads import Conversations, agent_sessions, conversations, first_prompt
from hierarchical_workloads import next_prompt, template_pieces

SYSTEMS = ("radix", "L1+L2", "L1+L2+L3", "L1+L2+L3 write-through")
DISK_SYSTEMS = SYSTEMS[2:]
WARM_UP = "Say hello in French."
SIZES = {"chat": {"conversations": 40, "turns": 8},
         "agent": {"conversations": 24, "turns": 6}}
"""The workloads' default sizes (the agent's contexts are longer: fewer, shorter sessions
keep a run's time near the chat workload's)."""
QUICK_SIZES = {"chat": {"conversations": 16, "turns": 3, "max_total_tokens": 2560},
               "agent": {"conversations": 16, "turns": 3, "max_total_tokens": 2560,
                         "document_tokens": 600}}
TIER_STATS = ("device_hit_tokens", "host_hit_tokens", "disk_hit_tokens", "loads",
              "load_seconds", "disk_read_seconds", "write_backs", "disk_writes_queued")


# Requests ------------------------------------------------------------------------------


def streamed_call(engine, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    """One call of ``prompts``, streamed: per request its TTFT, output ids and cached
    prompt tokens; the call's wall time in each row as ``call_s``."""
    params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    rows = [{"ttft": None, "output_ids": [], "cached_tokens": 0} for _ in prompts]
    start = time.perf_counter()
    for chunk in engine.generate(input_ids=prompts, sampling_params=params, stream=True):
        row = rows[chunk["index"]]
        if row["ttft"] is None and chunk["output_ids"]:
            row["ttft"] = time.perf_counter() - start
        row["output_ids"] = list(chunk["output_ids"])
        row["cached_tokens"] = chunk["meta_info"].get("cached_tokens", 0)
    elapsed = time.perf_counter() - start
    for row in rows:
        row["call_s"] = elapsed
    return rows


class History:
    """The prompts of every (conversation, turn), from the answers the first system gave."""

    def __init__(self, convs: Conversations, pieces):
        self.convs, self.pieces = convs, pieces
        self.answers: dict[tuple[int, int], list[int]] = {}
        self.prompts: dict[tuple[int, int], list[int]] = {}

    def prompt(self, conv: int, turn: int) -> list[int]:
        if (conv, turn) not in self.prompts:
            question = self.convs.questions[conv][turn]
            if turn == 0:
                system = self.convs.system[self.convs.system_of[conv]]
                self.prompts[conv, 0] = first_prompt(self.pieces, system, question)
            else:
                self.prompts[conv, turn] = next_prompt(
                    self.pieces, self.prompt(conv, turn - 1), self.answers[conv, turn - 1],
                    question)
        return self.prompts[conv, turn]

    def answer(self, conv: int, turn: int, output: list[int]) -> bool:
        """Records the first system's answer; True if ``output`` agrees with it."""
        return self.answers.setdefault((conv, turn), output) == output


def run_turns(engines: dict, history: History, turns: range, count: int, batch: int,
              new_tokens: int, shift: int) -> dict[str, dict]:
    """Sends ``turns`` of every conversation to every engine, turn by turn, ``batch``
    conversations a call; each call goes to the engines one after the other, in an order
    that rotates from call to call (by ``shift`` more each round)."""
    names = list(engines)
    calls: dict[str, list[list[dict]]] = {name: [] for name in names}
    mismatches = dict.fromkeys(names, 0)
    step = shift
    for turn in turns:
        for first in range(0, count, batch):
            convs = range(first, min(first + batch, count))
            step += 1
            for name in names[step % len(names):] + names[: step % len(names)]:
                prompts = [history.prompt(c, turn) for c in convs]
                out = streamed_call(engines[name], prompts, new_tokens)
                for c, row, prompt in zip(convs, out, prompts):
                    mismatches[name] += not history.answer(c, turn, row["output_ids"])
                    row["prompt_tokens"] = len(prompt)
                calls[name].append(out)
        print(f"  turn {turn} sent to every engine ({time.strftime('%H:%M:%S')})", flush=True)
    found = {}
    for name in names:
        flat = [row for call in calls[name] for row in call]
        found[name] = {
            "ttft": [row["ttft"] for row in flat],
            "wall_s": sum(call[0]["call_s"] for call in calls[name]),
            "requests": len(flat), "output_tokens": sum(len(r["output_ids"]) for r in flat),
            "prompt_tokens": sum(r["prompt_tokens"] for r in flat),
            "cached_tokens": sum(r["cached_tokens"] for r in flat),
            "mismatches": mismatches[name]}
    return found


def tier_stats(engine) -> dict:
    tiers = engine.get_server_info().get("hierarchical_cache") or {}
    found = {name: tiers.get(name, 0) for name in TIER_STATS}
    disk = tiers.get("disk") or {}
    found["disk_files"], found["disk_bytes_read"] = disk.get("files", 0), disk.get("bytes_read", 0)
    return found


def delta(after: dict, before: dict) -> dict:
    return {k: (after[k] - before[k]) if isinstance(after[k], (int, float)) and
            isinstance(before.get(k), (int, float)) else after[k] for k in after}


# Systems -------------------------------------------------------------------------------


def engine_options(system: str, args, disk_dir: str | None) -> dict:
    options = {"max_total_tokens": args.max_total_tokens}
    if system != "radix":
        options.update(enable_hierarchical_cache=True, hicache_ratio=args.hicache_ratio,
                       hicache_write_policy="write_back", hicache_block_tokens=32)
    if system in DISK_SYSTEMS:
        options.update(hicache_storage_backend="file", hicache_storage_dir=disk_dir)
    if system.endswith("write-through"):
        options["hicache_write_policy"] = "write_through"
    return options


def start(path: str, options: dict):
    """An Engine that has answered a short unrelated prompt; its start seconds."""
    import radixlm

    started = time.perf_counter()
    engine = radixlm.Engine(path, **options)
    engine.generate(WARM_UP, {"max_new_tokens": 2, "temperature": 0.0})
    return engine, time.perf_counter() - started


def run_round(path: str, history: History, args, round_no: int) -> dict[str, dict]:
    """Every system's engine at once: the workload interleaved call by call, then the
    engines with a disk tier restarted, then the next turn, interleaved again."""
    disk_dirs = {system: tempfile.mkdtemp(prefix="radixlm-hicache-bench-")
                 for system in DISK_SYSTEMS}
    options = {system: engine_options(system, args, disk_dirs.get(system))
               for system in SYSTEMS}
    engines: dict = {}
    results = {system: {"system": system, "restart_s": None} for system in SYSTEMS}
    try:
        for system in SYSTEMS:
            engines[system], results[system]["start_s"] = start(path, options[system])
        for phase, turns in (("workload", range(args.turns)),
                             ("next_turn", range(args.turns, args.turns + 1))):
            if phase == "next_turn":
                for system in DISK_SYSTEMS:
                    engines.pop(system).shutdown()
                    engines[system], results[system]["restart_s"] = start(path,
                                                                          options[system])
            before = {system: tier_stats(engine) for system, engine in engines.items()}
            found = run_turns({s: engines[s] for s in SYSTEMS}, history, turns,
                              args.conversations, args.batch, args.new_tokens, round_no)
            for system, engine in engines.items():
                found[system]["tiers"] = delta(tier_stats(engine), before[system])
                results[system][phase] = found[system]
    finally:
        for engine in engines.values():
            engine.shutdown()
        for directory in disk_dirs.values():
            shutil.rmtree(directory, ignore_errors=True)
    return results


# Figures -------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def figures(result: dict) -> dict:
    w, n = result["workload"], result["next_turn"]
    return {"req_s": w["requests"] / w["wall_s"], "tok_s": w["output_tokens"] / w["wall_s"],
            "p50": percentile(w["ttft"], 50), "p99": percentile(w["ttft"], 99),
            "next_p50": percentile(n["ttft"], 50), "next_p99": percentile(n["ttft"], 99)}


def median_over_rounds(rounds: list[dict[str, dict]], system: str, key: str,
                       against: str | None = None) -> float:
    values = [figures(r[system])[key] / (figures(r[against])[key] if against else 1)
              for r in rounds]
    return statistics.median(values)


def working_set(history: History, args) -> tuple[int, int]:
    """The sum of the conversations' final contexts, and their distinct tokens (the shared
    system prompts, or the agent sessions' one, counted once)."""
    final = [len(history.prompt(c, args.turns - 1)) + args.new_tokens
             for c in range(args.conversations)]
    shared = sum(len(s) for s in history.convs.system[: min(len(history.convs.system),
                                                            args.conversations)])
    distinct = sum(final) - sum(len(history.convs.system[history.convs.system_of[c]])
                               for c in range(args.conversations)) + shared
    return sum(final), distinct


def estimated_working_set(history: History, args) -> int:
    """The sum of the final contexts before any answer exists (template tokens included)."""
    between, after = history.pieces.next_turn
    per_turn = args.new_tokens + len(between) + len(after)
    return sum(len(history.prompt(c, 0)) + args.turns * per_turn
               + sum(map(len, history.convs.questions[c][1 : args.turns]))
               for c in range(args.conversations))


def workload_history(tokenizer, args) -> History:
    if args.workload == "agent":
        convs = agent_sessions(tokenizer, args.conversations, args.turns,
                               args.document_tokens, args.seed)
    else:
        convs = conversations(tokenizer, args.conversations, args.turns, seed=args.seed)
    return History(convs, template_pieces(tokenizer))


def workload_name(args) -> str:
    if args.workload == "agent":
        return (f"{args.conversations} agent sessions (one shared system prompt, then a "
                f"{args.document_tokens}-token document each)")
    return f"{args.conversations} conversations"


def tables(rounds: list[dict[str, dict]], args) -> str:
    last = rounds[-1]
    lines = ["### Multi-turn workload: throughput and time to first token", "",
             "| system | requests/s | output tok/s | throughput vs radix | p50 TTFT (s) | "
             "p99 TTFT (s) | p50 TTFT vs radix | cached prompt tokens | mismatches |",
             "|---|---|---|---|---|---|---|---|---|"]
    for system in SYSTEMS:
        w = last[system]["workload"]
        lines.append(
            f"| {system} | {median_over_rounds(rounds, system, 'req_s'):.2f} | "
            f"{median_over_rounds(rounds, system, 'tok_s'):.1f} | "
            f"{median_over_rounds(rounds, system, 'req_s', 'radix'):.2f}x | "
            f"{median_over_rounds(rounds, system, 'p50'):.3f} | "
            f"{median_over_rounds(rounds, system, 'p99'):.3f} | "
            f"{1 - median_over_rounds(rounds, system, 'p50', 'radix'):+.0%} lower | "
            f"{w['cached_tokens']}/{w['prompt_tokens']} | {w['mismatches']}/{w['requests']} |")
    lines += ["", "### Tiers (last round, workload): tokens", "",
              "| system | L1 hit tokens at admission | loaded L2 -> L1 | read L3 -> L2 | "
              "loads | load s | disk read s | blocks written back | disk writes queued |",
              "|---|---|---|---|---|---|---|---|---|"]
    for system in SYSTEMS[1:]:
        t = last[system]["workload"]["tiers"]
        lines.append(f"| {system} | {t['device_hit_tokens']} | {t['host_hit_tokens']} | "
                     f"{t['disk_hit_tokens']} | {t['loads']} | {t['load_seconds']:.2f} | "
                     f"{t['disk_read_seconds']:.2f} | {t['write_backs']} | "
                     f"{t['disk_writes_queued']} |")
    lines += ["", "### The next turn of every conversation (after a restart for the disk "
              "tiers)", "",
              "| system | how | p50 TTFT (s) | p99 TTFT (s) | p50 vs never stopped (L1+L2) | "
              "p50 vs radix | cached prompt tokens | L2 -> L1 | L3 -> L2 | start s |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for system in SYSTEMS:
        n, r = last[system]["next_turn"], last[system]
        how = "restarted on the same directory" if system in DISK_SYSTEMS else "never stopped"
        restart = "-" if r["restart_s"] is None else f"{r['restart_s']:.1f}"
        lines.append(
            f"| {system} | {how} | {median_over_rounds(rounds, system, 'next_p50'):.3f} "
            f"| {median_over_rounds(rounds, system, 'next_p99'):.3f} | "
            f"{median_over_rounds(rounds, system, 'next_p50', 'L1+L2'):.2f}x | "
            f"{median_over_rounds(rounds, system, 'next_p50', 'radix'):.2f}x | "
            f"{n['cached_tokens']}/{n['prompt_tokens']} | {n['tiers']['host_hit_tokens']} | "
            f"{n['tiers']['disk_hit_tokens']} | {restart} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 16 conversations of 3 turns, L1 of 2560 tokens "
                        "(agent: documents of 600 tokens)")
    parser.add_argument("--workload", choices=tuple(SIZES), default="chat")
    parser.add_argument("--conversations", type=int, default=None,
                        help="conversations (agent: sessions); default 40 (agent: 24)")
    parser.add_argument("--turns", type=int, default=None, help="default 8 (agent: 6)")
    parser.add_argument("--document-tokens", type=int, default=1500,
                        help="each agent session's document (agent only)")
    parser.add_argument("--batch", type=int, default=4, help="requests sent in one call")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--max-total-tokens", type=int, default=6144,
                        help="the device pool (L1) of every system")
    parser.add_argument("--hicache-ratio", type=float, default=None,
                        help="the host tier against L1 (default: room for the working set)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the raw records here")
    args = parser.parse_args()
    for key, value in SIZES[args.workload].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.quick:
        vars(args).update(QUICK_SIZES[args.workload])
    if args.document_tokens < 1:
        parser.error(f"--document-tokens must be at least 1, not {args.document_tokens}")

    import radixlm  # (before torch, which machine.py imports: radixlm sets the OpenMP wait)
    from machine import describe_machine
    from transformers import AutoTokenizer

    from radixlm.models.default_model import default_model_path

    del radixlm
    path = str(default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    history = workload_history(tokenizer, args)
    if args.hicache_ratio is None:
        args.hicache_ratio = max(2.0, math.ceil(1.5 * estimated_working_set(history, args)
                                                / args.max_total_tokens))
    print(describe_machine())
    print("load before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout
          .strip())
    rounds = []
    for round_no in range(args.rounds):
        results = run_round(path, history, args, round_no)
        for system in SYSTEMS:
            f = figures(results[system])
            print(f"round {round_no} {system}: {f['req_s']:.2f} req/s, p50 TTFT "
                  f"{f['p50']:.3f} s, next turn p50 {f['next_p50']:.3f} s", flush=True)
        rounds.append(results)
    total, distinct = working_set(history, args)
    print("load after:", subprocess.run(["uptime"], capture_output=True, text=True).stdout
          .strip())
    print(f"\n{workload_name(args)} x {args.turns} turns (+1 after the restart), "
          f"{args.new_tokens} new tokens, batches of {args.batch}; L1 (max_total_tokens) "
          f"{args.max_total_tokens}, host tier hicache_ratio {args.hicache_ratio:g}; working "
          f"set: final contexts {total} tokens ({total / args.max_total_tokens:.1f}x L1), "
          f"{distinct} distinct ({distinct / args.max_total_tokens:.1f}x L1); "
          f"{args.rounds} round(s)\n")
    print(tables(rounds, args))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": vars(args), "rounds": rounds}, out, indent=1)


if __name__ == "__main__":
    main()
