"""Does hosting the RequestTracker on the HTTP server's event loop pay?

The same Engine behind the same FastAPI app under uvicorn, two ways, side by side in one run
(rounds alternate, so drift hits both alike):

- ``hosted``: the server's loop hosts the RequestTracker for the server's life, so a
  request runs on it with no thread hop (what the Engine's ``serving_on_running_loop`` did
  before it was removed; ``hosted_on_server_loop`` below does it the same way);
- ``hop``: the RequestTracker stays on the Engine's own loop and every call hops there
  (``loop_bridge.run_on_loop``, and for a stream ``iterate_on_loop``, one
  ``call_soon_threadsafe`` per chunk): what the server does.

Each round sends ``--requests`` short requests one after another (latency: the hop is on
every request's path) for each workload, and ``--requests`` from ``--clients`` threads at
once. Prints each variant's median latency per request and the ratio hop / hosted.

    python benchmarks/bench_loop_hop.py                 # the default model
    python benchmarks/bench_loop_hop.py --rounds 6 --requests 40
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from live_server import LiveServer  # noqa: E402

import radixlm  # noqa: E402
from radixlm.runtime.engine.loop_bridge import run_on_loop  # noqa: E402
from radixlm.runtime.server.http_server import create_app  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe_machine  # noqa: E402

PROMPT = "The capital of France is"
WORKLOADS = {  # name -> (max_new_tokens, stream)
    "1 token": (1, False),
    "8 tokens": (8, False),
    "8 tokens streamed": (8, True),
}


@contextlib.asynccontextmanager
async def hosted_on_server_loop(engine: radixlm.Engine):
    """A new RequestTracker on the running (server's) loop, on the same sockets, while the
    context is open; then one on the Engine's own loop again."""
    own_tracker, own_loop = engine._tracker, engine._loop

    async def close() -> None:
        own_tracker.close()

    await run_on_loop(close(), own_loop)
    engine._tracker, engine._loop = await engine._make_request_tracker(), asyncio.get_running_loop()
    try:
        yield
    finally:
        engine._tracker.close()
        engine._loop = own_loop
        engine._tracker = await run_on_loop(engine._make_request_tracker(), own_loop)


def one_request(client: httpx.Client, url: str, tokens: int, stream: bool) -> float:
    body = {"text": PROMPT, "stream": stream,
            "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}
    started = time.perf_counter()
    if stream:
        with client.stream("POST", f"{url}/generate", json=body) as response:
            assert response.status_code == 200, response.status_code
            for _ in response.iter_lines():
                pass
    else:
        response = client.post(f"{url}/generate", json=body)
        assert response.status_code == 200, response.text
    return time.perf_counter() - started


def sequential(url: str, tokens: int, stream: bool, requests: int) -> list[float]:
    with httpx.Client(timeout=120) as client:
        one_request(client, url, tokens, stream)  # warm the connection
        return [one_request(client, url, tokens, stream) for _ in range(requests)]


def concurrent(url: str, tokens: int, requests: int, clients: int) -> list[float]:
    """Per-request wall time of ``requests`` sent from ``clients`` threads: total / count."""
    def worker(count: int) -> None:
        with httpx.Client(timeout=120) as client:
            for _ in range(count):
                one_request(client, url, tokens, False)

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(worker, [requests // clients] * clients))
    return [(time.perf_counter() - started) / (requests // clients * clients)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model path (default: the default model)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--clients", type=int, default=6)
    args = parser.parse_args()
    print(describe_machine())
    engine = radixlm.Engine(args.model)
    try:
        own_loop = engine._loop
        apps = {"hop": create_app(engine), "hosted": create_app(engine)}
        apps["hosted"].router.lifespan_context = lambda _: hosted_on_server_loop(engine)
        names = [*WORKLOADS, f"8 tokens, {args.clients} clients"]
        times: dict[tuple[str, str], list[float]] = {}
        for round_ in range(args.rounds):
            variants = ["hosted", "hop"] if round_ % 2 == 0 else ["hop", "hosted"]
            for variant in variants:
                server = LiveServer(apps[variant])
                try:
                    hosted = engine._loop is not own_loop
                    assert hosted == (variant == "hosted"), "the lifespan did not move it"
                    for name, (tokens, stream) in WORKLOADS.items():
                        times.setdefault((name, variant), []).extend(
                            sequential(server.url, tokens, stream, args.requests))
                    times.setdefault((names[-1], variant), []).extend(
                        concurrent(server.url, 8, args.requests, args.clients))
                finally:
                    server.close()
        print(f"{args.rounds} rounds x {args.requests} requests; median seconds per request")
        print(f"{'workload':<28}{'hosted':>10}{'hop':>10}{'hop/hosted':>12}")
        for name in names:
            hosted = statistics.median(times[(name, "hosted")])
            hop = statistics.median(times[(name, "hop")])
            print(f"{name:<28}{hosted:>10.4f}{hop:>10.4f}{hop / hosted:>12.3f}")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
