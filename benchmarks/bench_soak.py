"""Soak: minutes of mixed normal and abusive traffic, at a fixed rate, against one server.

Starts ``radixlm.launch_server`` on 127.0.0.1 (a free port, a bounded KV pool), times an idle
baseline of normal requests, then sends Poisson arrivals, open loop, for ``--duration``
seconds: normal requests (``/generate`` plain and streamed, ``/v1/chat/completions``,
``/v1/completions``; short prompts, 1-8 greedy tokens) and, with probability
``--abuse-share``, the abusive kinds of ``EXPECTED`` in turn: each once hurt the server, and
must now get its expected answer without stalling the rest. Reports the outcomes per (kind,
status), p50/p99 latency of normal requests against the baseline, every server process's RSS
after the baseline (taken once the KV pool has been filled once, ``fill_pool``, prompts of
many lengths have filled the matmul kernel cache, ``warm_shapes``, and one request of each
kind has run, so that what is measured is growth with traffic, not one-time costs) and
after the load (plus 10 s of settling), and whether the KV pool is idle at the end. Exits
non-zero if it is not, if ``/health`` is not 200, on any 5xx, on any outcome outside its
kind's expected set, or if the server needs SIGKILL to stop.

    python benchmarks/bench_soak.py --duration 600 [--rate 0.5] [--abuse-share 0.3] \
        [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # inherited by the server

import httpx  # noqa: E402
from machine import cpu_flags  # noqa: E402
from soak_requests import Target, abusive_request, greedy, random_ids  # noqa: E402

HOST = "127.0.0.1"
MAX_TOTAL_TOKENS = 16384
CLIENT_TIMEOUT_S = 120.0
"""A request still unanswered after this long counts as stalled (``ReadTimeout``)."""
SETTLE_S = 10.0
FILL_PROMPT_TOKENS = 4000
RSS_SAMPLE_S = 60.0
BASELINE_REQUESTS = 20
WARM_ROUNDS = 16
NORMAL_ROUTES = ("generate", "generate_stream", "chat", "completions")
EXPECTED = {
    "stop_regex_backtracking": {"200"},
    "lone_surrogate": {"400"},
    "huge_top_logprobs": {"400"},
    "max_logprobs_prompt": {"200"},
    "many_stop_strings": {"400"},
    "stop_strings_at_cap": {"200"},
    "chunked_upload": {"413"},
    "duplicate_rid": {"400"},
    "client_leaves": {"ReadTimeout"},  # the client gives up at 0.5 s; the server must abort
    "long_prefill": {"200"},
    "huge_chat": {"400"},
    "n_over_cap": {"400"},
    # Issue 54's classes, two or more members each.
    "beam_negative_length_penalty": {"400"},
    "beam_huge_length_penalty": {"400"},
    "beam_min_tokens_all_stop": {"400"},
    "client_chat_template": {"400"},
    "render_option_in_template_kwargs": {"400"},
    "template_variable_of_wrong_type": {"400"},
    "empty_messages": {"400"},
    "stop_token_ids_times_n": {"400"},
    "seed_over_64_bits": {"400"},
    "min_new_tokens_over_64_bits": {"400"},
    "top_k_over_64_bits_streamed": {"400"},
    "recursive_ebnf": {"400"},
    "self_referencing_schema": {"400"},
    "exponential_ebnf": {"400"},
}
ABUSIVE_KINDS = tuple(EXPECTED)  # before the normal kinds join
NORMAL_KINDS = tuple(f"normal_{route}" for route in NORMAL_ROUTES)
EXPECTED.update({kind: {"200"} for kind in NORMAL_KINDS})


@dataclasses.dataclass
class Outcome:
    kind: str
    status: str
    """The HTTP status, ``stream-error`` for an error event in a 200 stream, or the
    exception's class name for a transport error or a client-side timeout."""
    latency: float
    sent_at: float = 0.0
    """Seconds from the start of the soak."""


async def stream_generate(target: Target, body: dict) -> str:
    async with target.client.stream("POST", "/generate", json={**body, "stream": True},
                                    timeout=CLIENT_TIMEOUT_S) as response:
        if response.status_code != 200:
            await response.aread()
            return str(response.status_code)
        async for line in response.aiter_lines():
            data = line.removeprefix("data:").strip()
            if line.startswith("data:") and data != "[DONE]" and "error" in json.loads(data):
                return "stream-error"
    return "200"


def normal_request(route: str, target: Target, rng: random.Random) -> tuple[str, dict]:
    """(path, httpx ``post`` arguments) of a normal request on ``route``."""
    prompt = f"Write one sentence about the number {rng.randrange(10**6)}."
    tokens = rng.randint(1, 8)
    if route in ("generate", "generate_stream"):
        return "/generate", {"json": {"text": prompt, "sampling_params": greedy(tokens)}}
    openai = {"model": target.model, "max_tokens": tokens, "temperature": 0.0}
    if route == "chat":
        messages = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", {"json": {**openai, "messages": messages}}
    return "/v1/completions", {"json": {**openai, "prompt": prompt}}


async def timed(target: Target, kind: str, rng: random.Random) -> Outcome:
    start = time.perf_counter()
    try:
        path, request = (abusive_request(kind, target, rng) if kind in ABUSIVE_KINDS
                         else normal_request(kind.removeprefix("normal_"), target, rng))
        if kind == "normal_generate_stream":
            status = await stream_generate(target, request["json"])
        else:
            response = await target.client.post(path, **{"timeout": CLIENT_TIMEOUT_S, **request})
            status = str(response.status_code)
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        status = type(err).__name__
    return Outcome(kind, status, time.perf_counter() - start)


def soak_schedule(args, rng: random.Random) -> list[tuple[float, str]]:
    """(send time in seconds from the start, kind): Poisson arrivals at ``args.rate``, the
    abusive kinds and the normal routes each taken in turn."""
    abusive, normal = itertools.cycle(ABUSIVE_KINDS), itertools.cycle(NORMAL_KINDS)
    schedule, now = [], rng.expovariate(args.rate)
    while now < args.duration:
        schedule.append((now, next(abusive if rng.random() < args.abuse_share else normal)))
        now += rng.expovariate(args.rate)
    return schedule


async def run_soak(target: Target, schedule: list[tuple[float, str]], seed: int,
                   processes: dict[int, str]) -> tuple[list[Outcome], list, list]:
    """Open loop: each request is sent at its time, whether or not earlier ones are done.
    Also (seconds, running, waiting) of the Scheduler, sampled about once a second, and
    (seconds, {pid: RSS MiB}) of ``processes``, every ``RSS_SAMPLE_S``."""
    start, tasks, queue, rss_trace = time.perf_counter(), [], [], []

    async def sample_queue() -> None:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                info = (await target.client.get("/get_server_info", timeout=30)).json()
                queue.append((time.perf_counter() - start, info["num_running"],
                              info["num_waiting"]))
            at = time.perf_counter() - start
            if not rss_trace or at - rss_trace[-1][0] >= RSS_SAMPLE_S:
                rss_trace.append((at, {pid: rss_mib(pid) for pid in processes}))
            await asyncio.sleep(1.0)

    sampler = asyncio.create_task(sample_queue())
    for index, (at, kind) in enumerate(schedule):
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        tasks.append(asyncio.create_task(timed(target, kind, random.Random(seed * 7919 + index))))
    outcomes = list(await asyncio.gather(*tasks))
    sampler.cancel()
    for outcome, (at, _) in zip(outcomes, schedule):
        outcome.sent_at = at
    return outcomes, queue, rss_trace


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] if ordered else float("nan")


def server_processes(root: int) -> dict[int, str]:
    """pid -> label of ``root`` and of every process descended from it."""
    found, stack = {}, [root]
    while stack:
        pid = stack.pop()
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                argv = cmdline.read().decode(errors="replace").split("\0")
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as children:
                    stack.extend(int(child) for child in children.read().split())
        except OSError:
            continue
        # The runtime's processes run ``python -c <code> <role> <fd>``.
        found[pid] = "http server" if pid == root else (
            argv[3] if len(argv) > 3 and argv[1] == "-c" else " ".join(argv)[:40])
    return found


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            line = next(line for line in status if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) / 1024


def launch_server(args, log) -> subprocess.Popen:
    command = [sys.executable, "-m", "radixlm.launch_server", "--host", HOST,
               "--port", str(args.port), "--log-level", "warning",
               "--max-total-tokens", str(MAX_TOTAL_TOKENS)]
    if args.model_path is not None:
        command += ["--model-path", args.model_path]
    # Its own process group, so that stop_server can end whatever it leaves behind.
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_healthy(server: subprocess.Popen, port: int, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while server.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://{HOST}:{port}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"the server did not become healthy (exit code {server.poll()})")


def stop_server(server: subprocess.Popen) -> str:
    """SIGTERM, then SIGKILL to its whole process group if it has not exited 30 s later;
    says how it ended."""
    start, ended = time.monotonic(), "had already exited"
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
            ended = f"exited {server.returncode} {time.monotonic() - start:.1f} s after SIGTERM"
        except subprocess.TimeoutExpired:
            ended = "KILLED: still running 30 s after SIGTERM"
    with contextlib.suppress(ProcessLookupError):  # a child left by a server that died or hung
        os.killpg(server.pid, signal.SIGKILL)
    server.wait()
    return ended


async def fill_pool(client: httpx.AsyncClient, info: dict) -> None:
    """Prefills distinct prompts of more tokens in all than the KV pool holds, so that every
    slot has been written once before the start RSS is taken: a new pool's pages are mapped
    on first write, so its RSS grows with use up to the pool's size, which is no leak."""
    rng = random.Random(-100)
    chunk = FILL_PROMPT_TOKENS
    for _ in range(info["max_total_tokens"] // chunk + 1):
        ids = random_ids(rng, chunk, info["vocab_size"])
        reply = await client.post("/generate", json={"input_ids": ids,
                                                     "sampling_params": greedy(1)},
                                  timeout=CLIENT_TIMEOUT_S * 5)
        reply.raise_for_status()


async def warm_shapes(client: httpx.AsyncClient, info: dict) -> None:
    """Prompts of many lengths, several at a time, before the start RSS is taken: the
    scheduler's matmul library compiles a kernel per shape and keeps a bounded cache of
    them (``runtime_processes.ONEDNN_PRIMITIVE_CACHE``), which fills with the first few
    hundred shapes and is no leak either."""
    rng = random.Random(-300)

    async def one(length: int) -> None:
        reply = await client.post("/generate", json={
            "input_ids": random_ids(rng, length, info["vocab_size"]),
            "sampling_params": greedy(rng.randint(1, 8), ignore_eos=True)},
            timeout=CLIENT_TIMEOUT_S * 5)
        reply.raise_for_status()

    for _ in range(WARM_ROUNDS):
        await asyncio.gather(*(one(rng.randint(8, 800)) for _ in range(rng.randint(1, 8))))


async def measure(args, port: int, server_pid: int) -> dict:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=f"http://{HOST}:{port}", limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        info = (await client.get("/get_server_info")).json()
        target = Target(client, model, info["vocab_size"])
        await fill_pool(client, info)
        await warm_shapes(client, info)
        for i, kind in enumerate(ABUSIVE_KINDS + NORMAL_KINDS):  # one-time costs (caches,
            await timed(target, kind, random.Random(-200 - i))  # arenas) before the start
        baseline = [await timed(target, NORMAL_KINDS[i % len(NORMAL_KINDS)],
                                random.Random(-1 - i)) for i in range(BASELINE_REQUESTS)]
        processes = server_processes(server_pid)
        rss_start = {pid: rss_mib(pid) for pid in processes}
        schedule = soak_schedule(args, random.Random(args.seed))
        start = time.perf_counter()
        outcomes, queue, rss_trace = await run_soak(target, schedule, args.seed, processes)
        load_s = time.perf_counter() - start
        await asyncio.sleep(SETTLE_S)
        rss_end = {pid: rss_mib(pid) for pid in processes}
        info = (await client.get("/get_server_info")).json()
        health = (await client.get("/health")).status_code
    return {"baseline": baseline, "outcomes": outcomes, "queue": queue, "load_s": load_s,
            "info": info, "health": health, "model": model, "processes": processes,
            "rss_start": rss_start, "rss_end": rss_end, "rss_trace": rss_trace}


def report(args, found: dict) -> dict:
    """Prints the report; returns its numbers, with ``passed``: every check held."""
    outcomes, info = found["outcomes"], found["info"]
    counts = Counter((o.kind, o.status) for o in outcomes)
    unexpected = sorted({(k, s) for k, s in counts if s not in EXPECTED[k]})
    server_errors = sum(n for (_, s), n in counts.items() if s.startswith("5"))
    served = sum(o.status.startswith("2") for o in outcomes)
    pool_idle = (info["num_running"] == 0 and info["num_waiting"] == 0
                 and info["free_kv_tokens"] + info["cache_tokens"] == info["max_total_tokens"])
    print(f"cpu: {os.cpu_count()} cores, flags {cpu_flags()}; model {found['model']} on "
          f"{info['device']}, {info['dtype']}")
    print(f"soak: {args.duration:.0f} s at {args.rate}/s, abuse share {args.abuse_share}, seed "
          f"{args.seed}; the last answer came {found['load_s']:.1f} s after the start")
    print(f"requests: {len(outcomes)} sent, {served} served (2xx), {server_errors} 5xx, "
          f"{sum(not o.status[0].isdigit() for o in outcomes)} transport errors or timeouts; "
          f"at most {max((w for _, _, w in found['queue']), default=0)} waiting and "
          f"{max((r for _, r, _ in found['queue']), default=0)} running (sampled each second)")
    print(f"\n{'kind':<26} {'status':<12} {'count':>6} {'p50 s':>7} {'max s':>7}  expected")
    for (kind, status), count in sorted(counts.items()):
        seconds = [o.latency for o in outcomes if (o.kind, o.status) == (kind, status)]
        mark = "ok" if status in EXPECTED[kind] else "UNEXPECTED: " + "/".join(EXPECTED[kind])
        print(f"{kind:<26} {status:<12} {count:>6} {percentile(seconds, 50):>7.2f} "
              f"{max(seconds):>7.2f}  {mark}")
    latency = {}
    print(f"\n{'normal requests (2xx)':<26} {'n':>6} {'p50 s':>8} {'p99 s':>8}")
    for name, group in (("idle baseline", found["baseline"]), ("during soak", outcomes)):
        seconds = [o.latency for o in group if o.kind.startswith("normal_") and o.status == "200"]
        latency[name] = (percentile(seconds, 50), percentile(seconds, 99))
        print(f"{name:<26} {len(seconds):>6} {latency[name][0]:>8.3f} {latency[name][1]:>8.3f}")
    base, soak = latency["idle baseline"], latency["during soak"]
    print(f"{'ratio soak/baseline':<26} {'':>6} {soak[0] / base[0]:>7.2f}x "
          f"{soak[1] / base[1]:>7.2f}x")
    rss = {}
    print(f"\n{'process':<14} {'pid':>8} {'start MiB':>10} {'end MiB':>10} {'delta':>8}")
    for pid, label in found["processes"].items():
        start, end = found["rss_start"][pid], found["rss_end"][pid]
        rss[f"{label} {pid}"] = (start, end)
        delta = "gone" if end is None else f"{end - start:+.1f}"
        print(f"{label:<14} {pid:>8} {start:>10.1f} {end or 0:>10.1f} {delta:>8}")
    trace = found["rss_trace"]
    print(f"RSS MiB during the load, every {RSS_SAMPLE_S:.0f} s (growth with traffic shows "
          "as a rise to the end; a one-time cost, as a step that then holds):")
    for pid, label in found["processes"].items():
        samples = " ".join(f"{s[pid]:.0f}" if s[pid] is not None else "-" for _, s in trace)
        print(f"  {label:<14} {samples}")
    print(f"\npool idle: {'yes' if pool_idle else 'NO'} (running {info['num_running']}, waiting "
          f"{info['num_waiting']}, free {info['free_kv_tokens']} + cached {info['cache_tokens']}"
          f" of {info['max_total_tokens']} tokens); /health {found['health']}")
    return {"duration_s": args.duration, "rate": args.rate, "abuse_share": args.abuse_share,
            "seed": args.seed, "sent": len(outcomes), "served": served,
            "counts": {f"{k} {s}": n for (k, s), n in sorted(counts.items())},
            "latency_p50_p99_s": latency, "rss_mib": rss, "rss_trace": found["rss_trace"],
            "pool_idle": pool_idle,
            "health": found["health"], "unexpected": unexpected, "queue": found["queue"],
            "outcomes": [dataclasses.astuple(o) for o in outcomes],
            "passed": pool_idle and found["health"] == 200 and not server_errors
            and not unexpected}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--rate", type=float, default=0.5,
                        help="requests per second (keep it under the server's capacity: on "
                             "two CPU cores the 7,000-token prefills alone take ~30 s each, "
                             "and at 1/s they arrive every 40 s)")
    parser.add_argument("--abuse-share", type=float, default=0.3)
    parser.add_argument("--model-path", default=None, help="default: the default model")
    parser.add_argument("--port", type=int, default=None, help="default: a free port")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the numbers to this file")
    args = parser.parse_args()
    if args.port is None:
        with socket.socket() as probe:
            probe.bind((HOST, 0))
            args.port = probe.getsockname()[1]
    with tempfile.NamedTemporaryFile("w", prefix="bench_soak_", suffix=".log",
                                     delete=False) as log:
        server = launch_server(args, log)
        try:
            wait_healthy(server, args.port)
            found = asyncio.run(measure(args, args.port, server.pid))
        finally:
            shutdown = stop_server(server)
            print(f"server shutdown: {shutdown}; log {log.name}")
    numbers = report(args, found)
    numbers["shutdown"] = shutdown
    passed = numbers["passed"] = numbers["passed"] and not shutdown.startswith("KILLED")
    print("PASS" if passed else f"FAIL (unexpected outcomes: {numbers['unexpected']})")
    if args.json is not None:
        with open(args.json, "w") as out:
            json.dump(numbers, out, indent=1)
    if passed:
        os.unlink(log.name)
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
