"""Tensor parallelism on the CPU (gloo): a model split across 2 or 4 ranks serves what the
whole model serves (prompt logprobs within 1e-4 + 1e-4 relative, greedy tokens equal) for
every family, alone and batched, with prefix-cache hits, chunked prefill and retraction;
each rank's pool holds its share of the KV; two "nodes" started as two commands serve the
same; and a rank that dies fails the requests in flight within seconds, leaving no process
behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from live_server import free_port, stop_process, wait_healthy
from workloads import random_ids

import radixlm

SLOW = pytest.mark.slow  # (more ranks or families: CI's last stage)
GREEDY = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
ARCHITECTURES = {  # family -> (architecture, KV layout)
    "llama-gqa": ("LlamaForCausalLM", "gqa"),
    "llama-mqa": ("LlamaForCausalLM", "mqa"),
    "qwen3": ("Qwen3ForCausalLM", "gqa"),
    "mixtral": ("MixtralForCausalLM", "gqa"),
    "qwen2-moe": ("Qwen2MoeForCausalLM", "gqa"),
    "deepseek-v2-mla": ("DeepseekV2ForCausalLM", "gqa"),
}


def prompt_logprobs(result: dict) -> torch.Tensor:
    return torch.tensor([e[0] for e in result["meta_info"]["input_token_logprobs"]
                         if e[0] is not None])


def serve_both(engine_for, family: str, tp: int, requests: list[dict], **options):
    """(whole model's results, ``tp`` ranks' results) for ``requests``, in turn."""
    architecture, kv = ARCHITECTURES[family]
    results = []
    for size in (1, tp):
        engine = engine_for(architecture, kv, tp_size=size, **options)
        results.append([engine.generate(**request) for request in requests])
    return results


def assert_same(whole: list, split: list) -> None:
    for mine, theirs in zip(split, whole):
        mine = mine if isinstance(mine, list) else [mine]
        theirs = theirs if isinstance(theirs, list) else [theirs]
        for ours, want in zip(mine, theirs):
            assert ours["output_ids"] == want["output_ids"]
            if "input_token_logprobs" in want["meta_info"]:
                # A split sums each row-parallel product in another order; float32
                # logprobs near -10 drift by ~1e-4 that way (a wrong shard: by ~1).
                torch.testing.assert_close(prompt_logprobs(ours), prompt_logprobs(want),
                                           atol=1e-4, rtol=1e-4)


def mixed_requests() -> list[dict]:
    """A prompt alone, a batch of four sharing a prefix (with prompt logprobs, which are
    computed whole), then one more with that prefix (a cache hit)."""
    shared = random_ids(40, 24)
    logprobs = dict(sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
    return [
        dict(input_ids=random_ids(41, 37), **logprobs),
        dict(input_ids=[shared + random_ids(42 + i, 5 + 3 * i) for i in range(4)], **logprobs),
        dict(input_ids=shared + random_ids(47, 9), sampling_params=GREEDY),
    ]


FAST = {("llama-gqa", 2)}  # the rest in CI's last stage


@pytest.mark.parametrize("family,tp", [
    pytest.param(family, tp, marks=() if (family, tp) in FAST else SLOW)
    for family in ARCHITECTURES for tp in (2, 4)])
def test_every_family_split_serves_what_the_whole_model_serves(engine_for, family, tp):
    requests = mixed_requests()
    whole, split = serve_both(engine_for, family, tp, requests)
    assert_same(whole, split)
    assert split[2]["meta_info"]["cached_tokens"] >= 24  # the shared prefix hit


@SLOW
@pytest.mark.parametrize("family", ["llama-gqa", "mixtral", "deepseek-v2-mla"])
def test_chunked_prefill_and_retraction_run_on_every_rank(engine_for, family):
    # A 16-slot chunk size and a pool too small for four requests' outputs: prompts run in
    # chunks and decoding must retract (and later recompute) some requests.
    options = dict(chunked_prefill_size=16, max_total_tokens=200, max_running_requests=4)
    requests = [dict(input_ids=[random_ids(50 + i, 40) for i in range(4)],
                     sampling_params={**GREEDY, "max_new_tokens": 48}, return_logprob=True,
                     logprob_start_len=0)]
    whole, split = serve_both(engine_for, family, 2, requests, **options)
    assert_same(whole, split)
    engine = engine_for(*ARCHITECTURES[family], tp_size=2, **options)
    assert engine.get_server_info()["stats"]["retractions"] > 0


def test_beam_searches_fork_their_rows_on_every_rank(engine_for):
    """A beam search rewrites its rows every step (each beam points at its parent's slots):
    the ranks follow, and the beams and their scores are the whole model's."""
    widths = (2, 4, 8)
    requests = [dict(input_ids=[random_ids(60 + i, 20 + 15 * i) for i in range(3)],
                     sampling_params=[{"use_beam_search": True, "n": k, "max_new_tokens": 12}
                                      for k in widths])]
    whole, split = serve_both(engine_for, "llama-gqa", 2, requests)
    assert len(split[0]) == sum(widths)
    assert_same(whole, split)
    for ours, want in zip(split[0], whole[0]):
        assert abs(ours["meta_info"]["beam_score"] - want["meta_info"]["beam_score"]) < 1e-4


def test_each_rank_holds_half_the_kv_and_reports_it(engine_for):
    whole = engine_for("LlamaForCausalLM", "gqa", tp_size=1).get_server_info()
    info = engine_for("LlamaForCausalLM", "gqa", tp_size=2).get_server_info()
    assert (info["tp_size"], info["nnodes"]) == (2, 1)
    assert [r["rank"] for r in info["tp_ranks"]] == [0, 1]
    for rank in info["tp_ranks"]:
        assert rank["kv_tokens"] == whole["max_total_tokens"]
        assert rank["kv_bytes"] * 2 == whole["tp_ranks"][0]["kv_bytes"]


@SLOW
def test_an_idle_server_keeps_its_ranks_past_the_collective_timeout(engine_for):
    # The other ranks wait for the next step inside a broadcast; without keep-alives from
    # an idle rank 0 it times out (here after 4 s) and the ranks exit.
    engine = engine_for("LlamaForCausalLM", "gqa", tp_size=2, dist_timeout=4)
    ids = random_ids(90, 12)
    first = engine.generate(input_ids=ids, sampling_params=GREEDY)
    time.sleep(9)
    again = engine.generate(input_ids=ids, sampling_params=GREEDY)
    assert again["output_ids"] == first["output_ids"]


@SLOW
def test_bfloat16_ranks_agree_with_the_whole_model(engine_for):
    # Teacher-forced: both read the whole model's greedy output, and their greedy choice at
    # each position is compared (a free run would diverge for good at its first near-tie).
    whole = engine_for("LlamaForCausalLM", "gqa", tp_size=1, dtype="bfloat16")
    prompts = [random_ids(60 + i, 30) for i in range(4)]
    texts = [p + whole.generate(input_ids=p, sampling_params=GREEDY)["output_ids"]
             for p in prompts]
    request = dict(input_ids=texts, sampling_params={"max_new_tokens": 1},
                   return_logprob=True, logprob_start_len=29, top_logprobs_num=1)
    choices = []
    for size in (1, 2):
        engine = engine_for("LlamaForCausalLM", "gqa", tp_size=size, dtype="bfloat16")
        choices.append([entry[0][1] for out in engine.generate(**request)
                        for entry in out["meta_info"]["input_top_logprobs"] if entry])
    assert len(choices[0]) == len(choices[1]) >= 4 * 32
    same = sum(a == b for a, b in zip(*choices))
    assert same >= 0.95 * len(choices[0])


def test_sizes_that_do_not_divide_the_heads_are_refused(tiny_model_dir):
    path = tiny_model_dir("LlamaForCausalLM", "gqa")  # 4 query heads, 2 KV heads
    with pytest.raises(ValueError, match="--tp-size 3 does not divide"):
        radixlm.Engine(str(path), dtype="float32", tp_size=3)
    with pytest.raises(ValueError, match="multiple of nnodes"):
        radixlm.Engine(str(path), dtype="float32", tp_size=3, nnodes=2,
                       dist_init_addr="127.0.0.1:1")
    with pytest.raises(ValueError, match="needs dist_init_addr"):
        radixlm.Engine(str(path), dtype="float32", tp_size=2, nnodes=2)
    with pytest.raises(ValueError, match="radixlm serve --node-rank"):
        radixlm.Engine(str(path), dtype="float32", tp_size=2, nnodes=2, node_rank=1,
                       dist_init_addr="127.0.0.1:1")
    with pytest.raises(ValueError, match="do not combine"):
        radixlm.Engine(str(path), dtype="float32", tp_size=2, disaggregation_mode="prefill")


def serve_command(path, port: int, *options: str) -> list[str]:
    return [sys.executable, "-m", "radixlm.cli", "serve", "--model-path", str(path),
            "--port", str(port), "--dtype", "float32", "--max-total-tokens", "2048",
            "--log-level", "warning", *options]


@SLOW
def test_two_nodes_started_apart_serve_what_one_node_serves(engine_for, tiny_model_dir):
    path = tiny_model_dir("LlamaForCausalLM", "gqa")
    address = f"127.0.0.1:{free_port()}"
    port = free_port()
    nodes = [subprocess.Popen(serve_command(
        path, port, "--tp-size", "2", "--nnodes", "2", "--node-rank", str(rank),
        "--dist-init-addr", address), start_new_session=True) for rank in (1, 0)]
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, timeout=120)
        ids = random_ids(70, 30)
        got = httpx.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": GREEDY},
                         timeout=60).json()
        info = httpx.get(f"{url}/server_info", timeout=10).json()
        assert (info["tp_size"], info["nnodes"]) == (2, 2)
        want = engine_for("LlamaForCausalLM", "gqa", tp_size=2, max_total_tokens=2048
                          ).generate(input_ids=ids, sampling_params=GREEDY)
        assert got["output_ids"] == want["output_ids"]
    finally:
        stop_process(nodes[1])  # node 0 stops node 1's ranks
        nodes[0].wait(30)
    assert nodes[0].returncode == 0


@SLOW
def test_a_rank_killed_mid_stream_fails_its_callers_and_leaves_nothing_behind(tiny_model_dir):
    path = tiny_model_dir("LlamaForCausalLM", "gqa")
    port = free_port()
    server = subprocess.Popen(serve_command(path, port, "--tp-size", "2"),
                              start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout=120)
        rank = rank_process(server.pid)
        # Twelve streams of 480 tokens need three times the 2,048-slot pool, so most are
        # still waiting or decoding when the first token of one of them arrives.
        first_token = threading.Event()

        def stream(i: int) -> list[str]:
            body = {"input_ids": random_ids(80 + i, 20), "stream": True,  # (context: 512)
                    "sampling_params": {"max_new_tokens": 480, "ignore_eos": True}}
            lines = []
            with httpx.stream("POST", f"{url}/generate", json=body, timeout=60) as reply:
                for line in reply.iter_lines():
                    lines.append(line)
                    if line.startswith("data:"):
                        first_token.set()
            return lines

        with ThreadPoolExecutor(12) as pool:
            streams = [pool.submit(stream, i) for i in range(12)]
            assert first_token.wait(60)
            os.kill(rank, signal.SIGKILL)
            killed = time.monotonic()
            ended = [future.result() for future in streams]
        assert time.monotonic() - killed < 5
        failed = [lines for lines in ended if any("tensor-parallel rank 1" in line
                                                  for line in lines)]
        assert failed, [lines[-3:] for lines in ended]
        assert httpx.get(f"{url}/health", timeout=10).status_code != 200
    finally:
        stop_process(server)
    assert not descendants(server.pid)


@SLOW
def test_a_lost_node_fails_requests_naming_it_and_the_server_turns_unhealthy(tiny_model_dir):
    """Node 1 of two killed whole: node 0's next requests fail (503 naming the lost rank, not
    200 with an empty abort) and /health turns unhealthy within seconds, not at the next
    keep-alive."""
    path = tiny_model_dir("LlamaForCausalLM", "gqa")
    address, port = f"127.0.0.1:{free_port()}", free_port()
    nodes = [subprocess.Popen(serve_command(
        path, port, "--tp-size", "2", "--nnodes", "2", "--node-rank", str(rank),
        "--dist-init-addr", address), start_new_session=True) for rank in (1, 0)]
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout=120)
        body = {"input_ids": random_ids(71, 20), "sampling_params": GREEDY}
        assert httpx.post(f"{url}/generate", json=body, timeout=60).status_code == 200
        os.killpg(nodes[0].pid, signal.SIGKILL)  # node 1 and its ranks
        nodes[0].wait(30)
        killed = time.monotonic()
        replies = [httpx.post(f"{url}/generate", json=body, timeout=60) for _ in range(2)]
        assert all(r.status_code == 503 and "tensor-parallel rank" in r.text
                   for r in replies), [(r.status_code, r.text[:200]) for r in replies]
        assert httpx.get(f"{url}/health", timeout=10).status_code != 200
        assert time.monotonic() - killed < 30
    finally:
        stop_process(nodes[1])
        stop_process(nodes[0])


def descendants(pid: int) -> list[int]:
    """Processes whose parent chain reaches ``pid``."""
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        try:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            continue
        found += [int(c) for c in children]
        frontier += [int(c) for c in children]
    return found


def rank_process(server_pid: int) -> int:
    """The pid of the server's tensor-parallel rank 1 (a child of its scheduler)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for pid in descendants(server_pid):
            try:
                command = Path(f"/proc/{pid}/cmdline").read_text()
            except OSError:
                continue
            if "tp_worker" in command:
                return pid
        time.sleep(0.2)
    raise AssertionError("no tensor-parallel rank process found")
