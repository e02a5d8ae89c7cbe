"""Requests whose clients leave, and a server that stops: nothing runs for nobody, and no
caller loses its answer without an error it can see."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest
import uvicorn
from live_server import LiveServer, free_port
from runtime_checks import assert_engine_idle

from radixlm.runtime.server.graceful_shutdown import SHUTDOWN_REASON, DrainingServer
from radixlm.runtime.server.http_server import create_app

pytestmark = pytest.mark.slow  # servers of their own: CI's last stage

LONG = {"max_new_tokens": 480, "ignore_eos": True}
ONE_TOKEN = {"text": "Hello", "sampling_params": {"max_new_tokens": 1}}


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def aborted(url: str) -> float:
    """How many requests have ended aborted, by the server's metrics."""
    found = re.search(r'^radixlm_requests_finished_total{finish_reason="abort"} (\S+)$',
                      httpx.get(f"{url}/metrics").text, re.M)
    return float(found.group(1)) if found else 0.0


def idle(url: str) -> bool:
    info = httpx.get(f"{url}/get_server_info").json()
    return info["num_running"] == 0 and info["num_waiting"] == 0


@pytest.mark.parametrize(("route", "body"), [
    ("/generate", {"text": "The quick brown fox", "sampling_params": {**LONG, "n": 8}}),
    ("/generate", {"text": ["The quick brown fox"] * 8, "sampling_params": LONG}),
    ("/v1/completions", {"model": "MODEL", "prompt": "The quick brown fox", "n": 8,
                         "max_tokens": 480, "ignore_eos": True}),
], ids=["native_n", "native_batch", "openai"])
def test_a_client_that_leaves_a_non_streaming_request_aborts_it(live, route, body):
    url = live()
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    payload = json.loads(json.dumps(body).replace("MODEL", model))
    aborted_before = aborted(url)
    client_code = textwrap.dedent(f"""
        import httpx
        httpx.post("{url}{route}", json={payload!r}, timeout=120)
    """)
    client = subprocess.Popen([sys.executable, "-c", client_code])
    try:
        wait_until(lambda: httpx.get(f"{url}/get_server_info").json()["num_running"] >= 8, 30,
                   "the client's requests never ran")
    finally:
        client.kill()
        client.wait()
    wait_until(lambda: idle(url), 10, "the requests ran on after their client left")
    assert aborted(url) == aborted_before + 8  # ended by the disconnect, not run to the end
    info = httpx.get(f"{url}/get_server_info").json()
    assert info["free_kv_tokens"] + info["cache_tokens"] == info["max_total_tokens"]


class DrainingLiveServer:
    """``DrainingServer`` in a thread; ``stop_signal`` does what SIGTERM's handler does."""

    def __init__(self, engine, grace_s: float):
        self.port = free_port()
        config = uvicorn.Config(create_app(engine), host="127.0.0.1", port=self.port,
                                log_level="warning")
        self.server = DrainingServer(config, engine, grace_s)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, 30, "the server did not start")
        self.url = f"http://127.0.0.1:{self.port}"

    def stop_signal(self) -> None:
        self.server.handle_exit(signal.SIGTERM, None)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


async def _stream_events(client: httpx.AsyncClient, body: dict) -> list[str]:
    events = []
    async with client.stream("POST", "/generate", json={**body, "stream": True}) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    return events


async def _both_running(client: httpx.AsyncClient) -> None:
    """Waits until the two requests of a test run (their 480 tokens take far longer)."""
    deadline = time.monotonic() + 30
    while (await client.get("/get_server_info")).json()["num_running"] < 2:
        assert time.monotonic() < deadline, "the requests never ran"
        await asyncio.sleep(0.02)


def _stop_during_two_requests(live: DrainingLiveServer, after_signal=None):
    """A non-streaming and a streaming 480-token request; the stop signal once both run;
    then ``after_signal(client)`` (if given). Returns its result, the non-streaming reply
    and the stream's events, once the server has stopped by itself."""
    body = {"text": "The quick brown fox", "sampling_params": LONG}

    async def main():
        async with httpx.AsyncClient(base_url=live.url, timeout=120) as client:
            pending = asyncio.gather(client.post("/generate", json=body),
                                     _stream_events(client, body))
            await _both_running(client)
            live.stop_signal()
            extra = None if after_signal is None else await after_signal(client)
            return extra, *(await pending)

    try:
        result = asyncio.run(main())
        wait_until(lambda: not live.thread.is_alive(), 10, "the server did not stop")
    finally:
        live.close()
    return result


def test_on_sigterm_requests_in_flight_finish_within_the_grace_period(engine_for):
    engine = engine_for()

    async def once_draining(client: httpx.AsyncClient) -> httpx.Response:
        while (await client.get("/health")).status_code == 200:
            await asyncio.sleep(0.02)
        return await client.post("/generate", json=ONE_TOKEN)

    late, whole, events = _stop_during_two_requests(DrainingLiveServer(engine, grace_s=60),
                                                    once_draining)
    assert late.status_code == 503 and SHUTDOWN_REASON in late.text
    assert whole.status_code == 200 and whole.json()["meta_info"]["completion_tokens"] == 480
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["meta_info"]["completion_tokens"] == 480
    assert_engine_idle(engine)


def test_on_sigterm_requests_past_the_grace_period_end_with_an_error(engine_for):
    engine = engine_for()
    started = time.monotonic()
    # No grace at all: what runs at the signal ends.
    _, whole, events = _stop_during_two_requests(DrainingLiveServer(engine, grace_s=0.0))
    assert time.monotonic() - started < 30
    assert whole.status_code == 503 and SHUTDOWN_REASON in whole.text
    assert events[-1] == "[DONE]"
    assert SHUTDOWN_REASON in json.loads(events[-2])["error"]["message"]
    wait_until(lambda: engine.get_server_info()["num_running"] == 0, 5,
               "the Scheduler still runs the ended requests")
    assert_engine_idle(engine)


def test_health_fails_while_the_scheduler_is_stuck_with_work_waiting(engine_for):
    """A scheduler that stops turning (here: stopped by SIGSTOP; in the wild, one step that
    never ends) fails /health once ``health_timeout`` passes with requests waiting, and
    recovers when it turns again."""
    engine = engine_for(health_timeout=1.0)
    server = LiveServer(create_app(engine))
    scheduler = engine._runtime.processes["scheduler"]
    body = {"text": "The quick brown fox", "sampling_params": {"max_new_tokens": 8}}
    try:
        assert httpx.get(f"{server.url}/health").status_code == 200
        time.sleep(1.5)  # idle for longer than the bound: still healthy
        assert httpx.get(f"{server.url}/health").status_code == 200
        scheduler.send_signal(signal.SIGSTOP)
        try:
            replies = []
            client = threading.Thread(target=lambda: replies.append(
                httpx.post(f"{server.url}/generate", json=body, timeout=60)))
            client.start()
            wait_until(lambda: httpx.get(f"{server.url}/health").status_code == 503, 10,
                       "/health stayed 200 while the scheduler was stuck")
        finally:
            scheduler.send_signal(signal.SIGCONT)
        client.join(30)
        assert replies[0].status_code == 200
        wait_until(lambda: httpx.get(f"{server.url}/health").status_code == 200, 10,
                   "/health did not recover")
    finally:
        server.close()
