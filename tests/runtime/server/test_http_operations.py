"""Operating the HTTP server: metrics, backpressure, load, and clients that go away."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import textwrap
import time

import httpx
import pytest
from workloads import PROMPTS, greedy


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
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
    info = httpx.get(f"{url}/server_info").json()
    assert metric(after, "radixlm_tp_size") == info["tp_size"] == 1
    assert metric(after, 'radixlm_tp_rank_kv_bytes{tp_rank="0"}') == (
        info["max_total_tokens"] * info["kv_bytes_per_token"])


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


def _raw_json(body: dict) -> bytes:
    """``body`` as JSON with non-ASCII escaped, so a lone surrogate travels as ``\\udc00``
    (what any client may send; it is not valid Unicode once decoded)."""
    return json.dumps(body).encode()


@pytest.mark.parametrize("where", ["text", "stop", "rid", "extra_key"])
def test_text_that_is_not_unicode_is_a_400_that_leaves_nothing_in_flight(live, where):
    """With room for two requests in flight, a lone surrogate anywhere in a request is a
    400, and the refused requests hold no place: the next ones still run."""
    url = live(max_running_requests=2, max_queued_requests=0)
    bad = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    if where == "stop":
        bad["sampling_params"]["stop"] = ["\udc00"]
    elif where == "text":
        bad["text"] = "hi \udc00"
    else:
        bad[where] = "\udc00"
    headers = {"content-type": "application/json"}
    for _ in range(3):
        response = httpx.post(f"{url}/generate", content=_raw_json(bad), headers=headers,
                              timeout=30)
        assert response.status_code == 400, response.text
        assert "not valid Unicode" in response.json()["error"]["message"]
    ok = httpx.post(f"{url}/generate", timeout=30,
                    json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_openai_prompts_that_are_not_unicode_are_a_400(live, route):
    url = live()
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "max_tokens": 2}
    if route == "/v1/completions":
        body["prompt"] = "hi \udc00"
    else:
        body["messages"] = [{"role": "user", "content": "hi \udc00"}]
    response = httpx.post(f"{url}{route}", content=_raw_json(body),
                          headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 400, response.text


def test_one_rid_for_two_prompts_is_a_400_not_a_hang(live):
    url = live()
    response = httpx.post(f"{url}/generate", json={
        "text": ["a", "b"], "rid": ["same", "same"], "sampling_params": {"max_new_tokens": 2},
    }, timeout=30)
    assert response.status_code == 400
    assert "'same'" in response.json()["error"]["message"]


def test_a_chunked_body_over_the_limit_is_a_413(live):
    """No Content-Length (chunked transfer encoding): the body is counted as it arrives,
    and the route gets a 413 once it passes the limit (it used to read the whole body, and
    answer 400 after parsing it)."""
    url = live()

    def chunks():
        for _ in range(40):  # 40 MiB offered, 32 MiB allowed
            yield b"x" * 2**20

    response = httpx.post(f"{url}/generate", content=chunks(),
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 413
    assert "limited to" in response.json()["error"]["message"]
    ok = httpx.post(f"{url}/generate", timeout=30,
                    json={"text": "hi", "sampling_params": {"max_new_tokens": 1}})
    assert ok.status_code == 200


def test_the_hierarchical_cache_reports_each_tier_in_metrics(live, tmp_path):
    """Prompts that outgrow a small device pool: the evicted ones come back from the host
    tier; /metrics reports each tier's tokens, hits and traffic as /server_info does."""
    url = live(max_total_tokens=256, enable_hierarchical_cache=True, hicache_block_tokens=16,
               hicache_storage_backend="file", hicache_storage_dir=str(tmp_path / "kv"))
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} conversation {i} " * 6 for i in range(6)]
    for _ in range(2):  # the second round finds the first's KV evicted to the host tier
        for prompt in prompts:
            httpx.post(f"{url}/generate", timeout=60,
                       json={"text": prompt, "sampling_params": greedy(2)}).raise_for_status()
    text = httpx.get(f"{url}/metrics").text
    tiers = httpx.get(f"{url}/server_info").json()["hierarchical_cache"]
    assert tiers["host_hit_tokens"] > 0 and tiers["write_backs"] > 0
    assert metric(text, 'radixlm_hicache_hit_tokens{tier="host"}') == tiers["host_hit_tokens"]
    assert metric(text, 'radixlm_hicache_tokens{tier="host"}') == tiers["host"]["tokens"] > 0
    assert metric(text, 'radixlm_hicache_bytes_written{tier="host"}') == (
        tiers["host"]["bytes_written"])
    assert metric(text, 'radixlm_hicache_tokens{tier="device"}') == tiers["device_tokens"]
    assert metric(text, 'radixlm_hicache_load_seconds{tier="host"}') > 0
