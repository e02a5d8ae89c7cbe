"""A prefill server and a decode server behind SGLang's real router in PD mode
(``smg launch --pd-disaggregation``), as its users deploy them: every route answers what a
unified server answers, and the router's logprob merge gives the whole prompt's logprobs."""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest
import torch
from live_server import LiveServer, free_port, stop_process
from router_checks import CHAT_TEMPLATE, NEEDS_SMG, sse_data, wait_until_ready

import radixlm
from radixlm.runtime.server.http_server import create_app

pytestmark = [
    pytest.mark.slow,  # three engines and a router: CI's last stage
    NEEDS_SMG,
]

MODEL = "tiny"
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def servers(tiny_model_dir):
    """{"unified", "prefill", "decode"} -> URL, and the prefill server's bootstrap port."""
    port = free_port()
    modes = {"unified": {}, "prefill": dict(disaggregation_mode="prefill",
                                            disaggregation_bootstrap_port=port),
             "decode": dict(disaggregation_mode="decode")}
    engines, lives = [], {}
    try:
        for name, options in modes.items():
            engine = radixlm.Engine(str(tiny_model_dir()), dtype="float32",
                                    max_total_tokens=4096, **options)
            engine.tokenizer.chat_template = CHAT_TEMPLATE
            engines.append(engine)
            lives[name] = LiveServer(create_app(engine, served_model_name=MODEL))
        yield {name: live.url for name, live in lives.items()}, port
    finally:
        for live in lives.values():
            live.close()
        for engine in engines:
            engine.shutdown()


@pytest.fixture(scope="module")
def router(servers):
    urls, bootstrap_port = servers
    port = free_port()
    process = subprocess.Popen(
        ["smg", "launch", "--pd-disaggregation", "--host", "127.0.0.1", "--port", str(port),
         "--prefill", urls["prefill"], str(bootstrap_port), "--decode", urls["decode"],
         "--policy", "round_robin", "--prometheus-port", str(free_port()),
         "--log-level", "warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(process, url)  # both workers registered
        yield url
    finally:
        stop_process(process, 10)


def values(entries: list) -> torch.Tensor:
    return torch.tensor([e[0] for e in entries if e[0] is not None])


def test_generate_through_the_pd_router_matches_a_unified_server(router, servers):
    unified = servers[0]["unified"]
    body = {"text": "The quick brown fox", "sampling_params": GREEDY, "return_logprob": True,
            "logprob_start_len": 0}
    want = httpx.post(f"{unified}/generate", json=body, timeout=60).json()
    got = httpx.post(f"{router}/generate", json=body, timeout=60)
    assert got.status_code == 200, got.text
    got = got.json()
    assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"]
    # The router puts the prefill half's prompt logprobs in front of the decode half's.
    for key in ("input_token_logprobs", "output_token_logprobs"):
        torch.testing.assert_close(values(got["meta_info"][key]),
                                   values(want["meta_info"][key]), atol=1e-5, rtol=0)


def test_a_batch_and_a_stream_through_the_pd_router(router, servers):
    unified = servers[0]["unified"]
    batch = {"input_ids": [[5, 6, 7, 8], [9, 10, 11]], "sampling_params": GREEDY}
    want = httpx.post(f"{unified}/generate", json=batch, timeout=60).json()
    got = httpx.post(f"{router}/generate", json=batch, timeout=60)
    assert got.status_code == 200, got.text
    assert [o["output_ids"] for o in got.json()] == [o["output_ids"] for o in want]
    body = {"text": "Once upon a time", "sampling_params": GREEDY, "stream": True}
    reply = httpx.post(f"{router}/generate", json=body, timeout=60)
    events = sse_data(reply)
    assert reply.status_code == 200 and events[-1] == "[DONE]"
    plain = httpx.post(f"{unified}/generate", json={**body, "stream": False}, timeout=60)
    assert json.loads(events[-2])["text"] == plain.json()["text"]


def test_openai_routes_through_the_pd_router(router, servers):
    unified = servers[0]["unified"]
    completion = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 8,
                  "temperature": 0, "ignore_eos": True}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    for route, body in (("/v1/completions", completion), ("/v1/chat/completions", chat),
                        ("/v1/chat/completions", {**chat, "n": 2})):
        want = httpx.post(f"{unified}{route}", json=body, timeout=60).json()
        got = httpx.post(f"{router}{route}", json=body, timeout=60)
        assert got.status_code == 200, (route, got.text)
        key = "text" if route == "/v1/completions" else "message"
        assert [c[key] for c in got.json()["choices"]] == [c[key] for c in want["choices"]]
        streamed = httpx.post(f"{router}{route}", json={**body, "stream": True}, timeout=60)
        assert streamed.status_code == 200 and sse_data(streamed)[-1] == "[DONE]"


def test_control_routes_and_idle_pools_after_the_pd_router(router, servers):
    info = httpx.get(f"{router}/get_model_info", timeout=10)
    assert info.status_code == 200 and info.json()["model_type"] == "llama"
    flushed = httpx.post(f"{router}/flush_cache", timeout=10)
    assert flushed.status_code == 200, flushed.text
    for name in ("prefill", "decode"):
        state = httpx.get(f"{servers[0][name]}/server_info", timeout=10).json()
        assert state["disaggregation_mode"] == name
        assert state["disaggregation"]["waiting"] == 0 and state["num_running"] == 0
        assert state["free_kv_tokens"] == state["max_total_tokens"]  # flushed: all free
