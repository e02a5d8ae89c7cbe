"""Two radixlm servers behind SGLang's real router (``smg`` from ``sglang-router``), as its
users run replicas: every route a client uses answers through the router as it does
straight from a server."""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest
from live_server import LiveServer, free_port, stop_process
from router_checks import CHAT_TEMPLATE, NEEDS_SMG, sse_data, wait_until_ready

import radixlm
from radixlm.runtime.server.http_server import create_app

pytestmark = [
    pytest.mark.slow,  # two engines and two routers: CI's last stage
    NEEDS_SMG,
]

MODEL = "tiny"
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def workers(tiny_model_dir):
    """Two servers over the same tiny model (the router needs distinct URLs)."""
    engines, servers = [], []
    try:
        for _ in range(2):
            engine = radixlm.Engine(str(tiny_model_dir()), dtype="float32",
                                    max_total_tokens=4096, tool_call_parser="qwen25")
            engine.tokenizer.chat_template = CHAT_TEMPLATE
            engines.append(engine)
            servers.append(LiveServer(create_app(engine, served_model_name=MODEL)))
        yield [server.url for server in servers]
    finally:
        for server in servers:
            server.close()
        for engine in engines:
            engine.shutdown()


def start_router(worker_urls: list[str], policy: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    router = subprocess.Popen(
        ["smg", "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
         "--prometheus-port", str(free_port()), "--log-level", "warn",
         "--worker-urls", *worker_urls],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    wait_until_ready(router, url, "/get_model_info")  # a worker registered
    return router, url


@pytest.fixture(scope="module", params=["round_robin", "cache_aware"])
def router(request, workers):
    process, url = start_router(workers, request.param)
    try:
        yield url
    finally:
        stop_process(process, 10)



def test_generate_through_the_router_matches_a_server(router, workers):
    body = {"text": "The quick brown fox", "sampling_params": GREEDY}
    want = httpx.post(f"{workers[0]}/generate", json=body, timeout=60).json()
    for _ in range(4):  # both workers, whichever the policy picks
        got = httpx.post(f"{router}/generate", json=body, timeout=60)
        assert got.status_code == 200, got.text
        assert got.json()["output_ids"] == want["output_ids"]
        assert got.json()["text"] == want["text"]


def test_a_stream_through_the_router(router, workers):
    body = {"text": "The quick brown fox", "sampling_params": GREEDY, "stream": True}
    reply = httpx.post(f"{router}/generate", json=body, timeout=60)
    events = sse_data(reply)
    assert reply.status_code == 200 and events[-1] == "[DONE]"
    want = httpx.post(f"{workers[1]}/generate", json={**body, "stream": False}, timeout=60)
    assert json.loads(events[-2])["text"] == want.json()["text"]


def test_openai_routes_through_the_router(router, workers):
    completion = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 8,
                  "temperature": 0, "ignore_eos": True}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    for route, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        want = httpx.post(f"{workers[0]}{route}", json=body, timeout=60).json()
        got = httpx.post(f"{router}{route}", json=body, timeout=60)
        assert got.status_code == 200, (route, got.text)
        key = "text" if route == "/v1/completions" else "message"
        assert got.json()["choices"][0][key] == want["choices"][0][key]
        streamed = httpx.post(f"{router}{route}", json={**body, "stream": True}, timeout=60)
        assert streamed.status_code == 200 and sse_data(streamed)[-1] == "[DONE]"


def test_tool_calls_through_the_router(router, workers):
    """A forced call (the grammar writes it, whatever the random model prefers) comes back
    through the router as from the server, whole and streamed."""
    zone = {"type": "object", "properties": {"zone": {"type": "string",
                                                      "enum": ["UTC", "JST"]}},
            "required": ["zone"]}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Time?"}],
            "max_tokens": 200, "temperature": 0, "parallel_tool_calls": False,
            "tools": [{"type": "function", "function": {"name": "get_time",
                                                        "parameters": zone}}],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    want = httpx.post(f"{workers[0]}/v1/chat/completions", json=body, timeout=60).json()
    got = httpx.post(f"{router}/v1/chat/completions", json=body, timeout=60)
    assert got.status_code == 200, got.text
    call = got.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call == want["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_time" and json.loads(call["arguments"])["zone"] in ("UTC", "JST")
    assert got.json()["choices"][0]["finish_reason"] == "tool_calls"
    streamed = httpx.post(f"{router}/v1/chat/completions", json={**body, "stream": True},
                          timeout=60)
    pieces = [piece for data in sse_data(streamed)[:-1]
              for choice in json.loads(data)["choices"]
              for piece in choice["delta"].get("tool_calls") or ()]
    assert pieces[0]["function"]["name"] == "get_time"
    assert "".join(p["function"].get("arguments", "") for p in pieces) == call["arguments"]


def test_control_routes_through_the_router(router):
    info = httpx.get(f"{router}/get_model_info", timeout=10)
    assert info.status_code == 200 and info.json()["model_type"] == "llama"
    flushed = httpx.post(f"{router}/flush_cache", timeout=10)
    assert flushed.status_code == 200, flushed.text
