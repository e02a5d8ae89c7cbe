"""Prefill/decode disaggregation against one unified server, side by side in one run.

Starts three servers on 127.0.0.1 (``radixlm.launch_server``): a unified one, a prefill one
and a decode one (``tcp`` transfer). Each round sends the same open-loop workload, streamed
through ``/generate``, first to the unified server, then as pairs (the same body with
``bootstrap_*`` fields to the prefill and the decode server at once, as SGLang's router
does; the decode server's stream is the answer): long prompts with short outputs mixed with
short prompts and long outputs. Reports TTFT, inter-token latency p50/p99, output tokens per
second and the KV moved, medians over rounds; then the transfer alone (gather, ZMQ over
TCP, scatter between two pools shaped like the model's) against a plain memory copy of the
same bytes.

On a two-core CPU all processes share the cores, so PD cannot be faster here: what this
shows is the mechanism's overhead, not the speed-up of separate machines.

    python benchmarks/bench_disaggregation.py [--rounds 3] [--requests 12] [--model-path P]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import socket
import statistics
import subprocess
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # inherited by the servers

import httpx  # noqa: E402
import torch  # noqa: E402
from machine import cpu_flags  # noqa: E402

HOST = "127.0.0.1"
LONG_PROMPT, LONG_OUTPUT = 768, 8
SHORT_PROMPT, SHORT_OUTPUT = 24, 96


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def launch(model_path: str | None, *options: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "radixlm.launch_server", "--host", HOST, "--port", str(port),
               "--log-level", "warning", "--max-total-tokens", "16384", *options]
    if model_path is not None:
        command += ["--model-path", model_path]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                               start_new_session=True)
    return process, f"http://{HOST}:{port}"


def wait_healthy(process: subprocess.Popen, url: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not become healthy (exit code {process.poll()})")


def workload(requests: int, vocab_size: int, seed: int) -> list[tuple[float, dict]]:
    """(arrival second, body): half long prompts with short outputs, half the reverse."""
    rng = random.Random(seed)
    arrivals, at = [], 0.0
    for i in range(requests):
        prompt, output = (LONG_PROMPT, LONG_OUTPUT) if i % 2 else (SHORT_PROMPT, SHORT_OUTPUT)
        body = {"input_ids": [rng.randrange(vocab_size) for _ in range(prompt)],
                "sampling_params": {"max_new_tokens": output, "temperature": 0,
                                    "ignore_eos": True},
                "stream": True}
        arrivals.append((at, body))
        at += rng.expovariate(0.5)
    return arrivals


async def timed_stream(client: httpx.AsyncClient, url: str, body: dict) -> list[float]:
    """Times (since the request) at which each streamed chunk arrived."""
    start, times = time.perf_counter(), []
    async with client.stream("POST", f"{url}/generate", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter() - start)
    return times


async def one(client, urls: dict, pd: bool, at: float, body: dict, start: float) -> list[float]:
    await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
    if not pd:
        return await timed_stream(client, urls["unified"], body)
    paired = {**body, "bootstrap_host": HOST, "bootstrap_port": urls["bootstrap_port"],
              "bootstrap_room": random.randrange(2**63)}
    first = client.post(f"{urls['prefill']}/generate", json={**paired, "stream": False})
    answer, times = await asyncio.gather(first, timed_stream(client, urls["decode"], paired))
    answer.raise_for_status()
    return times


async def run_round(urls: dict, pd: bool, arrivals) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        streams = await asyncio.gather(*(one(client, urls, pd, at, body, start)
                                         for at, body in arrivals))
        makespan = time.perf_counter() - start
    ttft = [times[0] for times in streams]
    gaps = [b - a for times in streams for a, b in zip(times, times[1:])]
    tokens = sum(body["sampling_params"]["max_new_tokens"] for _, body in arrivals)
    return {"ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "itl_p50": pct(gaps, 50),
            "itl_p99": pct(gaps, 99), "tok_s": tokens / makespan}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def transfer_speed(tokens: int, layers: int, kv_heads: int, head_dim: int,
                   dtype: torch.dtype, backend: str = "tcp", run: int = 64,
                   repeats: int = 5) -> tuple[float, float]:
    """(GB/s of a transfer through ``backend``'s links: the request, the KV moved from
    scattered runs of ``run`` consecutive slots into other such runs, the receipt; GB/s of
    a plain copy of the same bytes)."""
    from radixlm.kv_cache.memory_pool import MHATokenToKVPool
    from radixlm.runtime.disaggregation import transfer_messages as wire
    from radixlm.runtime.disaggregation.kv_rows import KVLayout
    from radixlm.runtime.disaggregation.mooncake_backend import (
        MooncakeDecodeLink,
        MooncakePrefillLink,
    )
    from radixlm.runtime.disaggregation.transfer_backend import TcpDecodeLink, TcpPrefillLink

    source = MHATokenToKVPool(tokens + 1, layers, kv_heads, head_dim, dtype, "cpu")
    target = MHATokenToKVPool(tokens + 1, layers, kv_heads, head_dim, dtype, "cpu")
    for buffer in source.layer_buffers():
        buffer.copy_(torch.randn(buffer.shape))
    sent, received = scattered_slots(tokens, run), scattered_slots(tokens, run)
    layout = KVLayout.of(source.layer_buffers(), 1)
    if backend == "mooncake":
        sender = MooncakePrefillLink(HOST, source.layer_buffers())
        receiver = MooncakeDecodeLink(HOST, target.layer_buffers())
    else:
        sender, receiver = TcpPrefillLink(HOST, source.layer_buffers()), TcpDecodeLink(
            target.layer_buffers())
    nbytes = tokens * source.bytes_per_token()
    plain = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    destination = torch.empty_like(plain)
    destination.copy_(plain)  # (its pages mapped before it is timed)
    moved, copied = [], []
    try:
        for room in range(repeats):
            start = time.perf_counter()
            wanted = wire.KVWanted(room, tokens, 0, layout, receiver.target(received))
            receiver.send(sender.endpoint, wanted)
            while not (asked := sender.poll()):
                time.sleep(0)
            peer, wanted = asked[0]
            assert sender.send_kv(peer, wire.KVSent(room, 0, tokens), wanted, sent) is None
            while not (arrived := receiver.poll()):
                time.sleep(0)
            assert receiver.receive(*arrived[0], received) is None
            moved.append(time.perf_counter() - start)
            start = time.perf_counter()
            destination.copy_(plain)
            copied.append(time.perf_counter() - start)
    finally:
        sender.close()
        receiver.close()
    assert all(torch.equal(a[sent], b[received]) for a, b in
               zip(source.layer_buffers(), target.layer_buffers()))
    return nbytes / statistics.median(moved) / 1e9, nbytes / statistics.median(copied) / 1e9


def scattered_slots(tokens: int, run: int) -> torch.Tensor:
    """Slots 1..``tokens`` in shuffled runs of ``run`` consecutive slots (a pool that has
    served a while)."""
    runs = torch.arange(tokens).split(run)
    return torch.cat([runs[i] for i in torch.randperm(len(runs))]) + 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--model-path", default=None, help="default: the default model")
    args = parser.parse_args()
    bootstrap_port = free_port()
    servers = {
        "unified": launch(args.model_path),
        "prefill": launch(args.model_path, "--disaggregation-mode", "prefill",
                          "--disaggregation-bootstrap-port", str(bootstrap_port)),
        "decode": launch(args.model_path, "--disaggregation-mode", "decode"),
    }
    try:
        for process, url in servers.values():
            wait_healthy(process, url)
        urls = {name: url for name, (_, url) in servers.items()}
        urls["bootstrap_port"] = bootstrap_port
        info = httpx.get(f"{urls['decode']}/server_info", timeout=10).json()
        warm_up = workload(2, info["vocab_size"], seed=-1)
        asyncio.run(run_round(urls, True, warm_up))
        asyncio.run(run_round(urls, False, warm_up))
        rounds = {"unified": [], "pd": []}
        for seed in range(args.rounds):  # interleaved; new prompts each round (no cache hits)
            arrivals = workload(args.requests, info["vocab_size"], seed)
            rounds["unified"].append(asyncio.run(run_round(urls, False, arrivals)))
            rounds["pd"].append(asyncio.run(run_round(urls, True, arrivals)))
        moved = httpx.get(f"{urls['decode']}/server_info", timeout=10).json()
    finally:
        for process, _ in servers.values():
            process.terminate()
        for process, _ in servers.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(30)
    print(f"cpu: {os.cpu_count()} cores, flags {cpu_flags()}; model {info.get('model_path')}, "
          f"{info['dtype']}; {args.requests} requests per round ({LONG_PROMPT}-token prompts "
          f"x {LONG_OUTPUT} out, {SHORT_PROMPT} x {SHORT_OUTPUT}), {args.rounds} rounds")
    print(f"{'':10}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>10}{'ITL p99':>10}{'tok/s':>8}")
    medians = {}
    for name, results in rounds.items():
        medians[name] = {k: statistics.median(r[k] for r in results) for k in results[0]}
        m = medians[name]
        print(f"{name:10}{m['ttft_p50']:10.3f}{m['ttft_p99']:10.3f}{m['itl_p50']:10.4f}"
              f"{m['itl_p99']:10.4f}{m['tok_s']:8.1f}")
    ratio = {k: medians["pd"][k] / medians["unified"][k] for k in medians["pd"]}
    print("pd/unified" + "".join(f"{ratio[k]:9.2f}x" for k in
                                 ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")) +
          f"{ratio['tok_s']:7.2f}x")
    stats = moved["disaggregation"]
    print(f"KV moved: {stats['kv_transfers']} transfers, {stats['kv_tokens_received']} tokens, "
          f"{stats['kv_bytes_received'] / 2**20:.1f} MiB "
          f"({moved['kv_bytes_per_token']} B per token)")
    shape = model_kv_shape(args.model_path)
    dtype = getattr(torch, info["dtype"])
    tokens = LONG_PROMPT * 4
    for backend, run in (("tcp", 64), ("tcp", 1), ("mooncake", 64), ("mooncake", 1)):
        try:
            speed, copy = transfer_speed(tokens, *shape, dtype, backend, run)
        except ValueError as err:  # Mooncake's engine is not installed
            print(f"transfer through {backend}: skipped ({err})")
            continue
        print(f"transfer of {tokens} tokens' KV in runs of {run} slots: {backend} "
              f"{speed:.2f} GB/s, plain copy {copy:.2f} GB/s ({speed / copy:.2f}x)")


def model_kv_shape(model_path: str | None) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of the served model."""
    from radixlm.models.default_model import resolve_model_path
    from radixlm.models.model_config import ModelConfig

    config = ModelConfig.from_path(str(resolve_model_path(model_path)), False)
    return config.num_layers, config.num_kv_heads, config.head_dim


if __name__ == "__main__":
    main()
