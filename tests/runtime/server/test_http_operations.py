"""Operating the HTTP server: metrics, backpressure, load, and clients that go away."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import textwrap
import time

import httpx
import pytest
from live_server import LiveServer
from workloads import PROMPTS, greedy

from radixlm.runtime.server.http_server import create_app


@pytest.fixture
def live(engine_for):
    servers = []

    def start(**options):
        server = LiveServer(create_app(engine_for(**options)))
        servers.append(server)
        return server.url

    yield start
    for server in servers:
        server.close()


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    assert found, f"{name} missing from /metrics"
    return float(found.group(1))


def test_each_latency_histogram_counts_every_finished_request(live):
    url = live()
    before = httpx.get(f"{url}/metrics").text
    counts_before = {name: metric(before, f"{name}_count") for name in (
        "radixlm_time_to_first_token_seconds", "radixlm_inter_token_latency_seconds",
        "radixlm_e2e_request_latency_seconds")}
    httpx.post(f"{url}/generate", timeout=60,
               json={"text": PROMPTS[:4], "sampling_params": greedy(5)}).raise_for_status()
    httpx.post(f"{url}/generate", timeout=60,
               json={"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 0}})
    after = httpx.get(f"{url}/metrics").text
    for name, count in counts_before.items():
        assert metric(after, f"{name}_count") == count + 5
    assert metric(after, "radixlm_num_running_requests") == 0
    assert 0 <= metric(after, "radixlm_kv_usage_ratio") <= 1


def test_256_concurrent_requests_all_succeed(live):
    url = live()

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            replies = await asyncio.gather(*(
                client.post("/generate", json={"text": PROMPTS[i % 5],
                                               "sampling_params": greedy(4)})
                for i in range(256)
            ))
        return replies

    replies = asyncio.run(main())
    assert all(r.status_code == 200 for r in replies)
    assert all(r.json()["meta_info"]["completion_tokens"] == 4 for r in replies)


def test_beyond_the_queue_limit_requests_get_503_and_accepted_ones_succeed(live):
    url = live(max_running_requests=4, max_queued_requests=8)

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await asyncio.gather(*(
                client.post("/generate", json={"text": PROMPTS[i % 5],
                                               "sampling_params": greedy(64)})
                for i in range(48)
            ))

    replies = asyncio.run(main())
    codes = [r.status_code for r in replies]
    assert set(codes) == {200, 503}
    assert codes.count(200) >= 12
    assert all(r.json()["meta_info"]["completion_tokens"] == 64
               for r in replies if r.status_code == 200)
    refused = next(r for r in replies if r.status_code == 503)
    assert "busy" in refused.json()["error"]["message"]


def test_a_killed_client_aborts_its_streams_and_frees_the_kv(live):
    url = live()
    client_code = textwrap.dedent(f"""
        import asyncio, httpx
        async def stream(client):
            body = {{"text": "The quick brown fox", "stream": True,
                     "sampling_params": {{"max_new_tokens": 480, "ignore_eos": True}}}}
            async with client.stream("POST", "/generate", json=body) as response:
                async for _ in response.aiter_lines():
                    pass
        async def main():
            async with httpx.AsyncClient(base_url="{url}", timeout=120) as client:
                await asyncio.gather(*(stream(client) for _ in range(16)))
        asyncio.run(main())
    """)
    client = subprocess.Popen([sys.executable, "-c", client_code])
    deadline = time.monotonic() + 30
    while httpx.get(f"{url}/get_server_info").json()["num_running"] < 16:
        assert time.monotonic() < deadline, "the client's streams never all ran"
        time.sleep(0.05)
    client.kill()
    client.wait()
    killed = time.monotonic()
    while True:
        info = httpx.get(f"{url}/get_server_info").json()
        if info["num_running"] == 0 and info["num_waiting"] == 0:
            break
        assert time.monotonic() - killed < 2, info
        time.sleep(0.05)
    assert info["free_kv_tokens"] + info["cache_tokens"] == info["max_total_tokens"]
    assert info["cache_protected_tokens"] == 0


def test_an_oversized_body_is_refused(live):
    url = live()
    response = httpx.post(f"{url}/generate", content=b"x" * (33 * 2**20),
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 413
