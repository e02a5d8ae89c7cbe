"""The ``radixlm`` command, run as a real subprocess."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "radixlm.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_generate_streams_a_raw_prompt_through_a_tiny_model(tiny_model_dir):
    path = tiny_model_dir()
    result = run_cli("generate", "The quick brown fox", "--model-path", str(path), "--raw",
                     "--max-new-tokens", "8", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("\n")
    assert len(result.stdout.strip()) > 0


def test_generate_reports_bad_input_without_a_traceback(tiny_model_dir):
    path = tiny_model_dir()
    result = run_cli("generate", "hello", "--model-path", str(path), "--temperature", "-1")
    assert result.returncode == 2
    assert "temperature" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.default_model
def test_readme_command_answers_with_the_default_model():
    result = run_cli("generate", "What is the capital of Japan?", "--max-new-tokens", "32")
    assert result.returncode == 0, result.stderr
    assert "Tokyo" in result.stdout


def test_serve_answers_over_http_and_exits_on_sigterm(tiny_model_dir):
    import signal

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "radixlm.launch_server", "--model-path", str(tiny_model_dir()),
         "--dtype", "float32", "--max-total-tokens", "2048", "--port", str(port),
         "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        ready = server.stdout.readline()
        assert f"http://127.0.0.1:{port}" in ready, server.stderr.read()
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        out = httpx.post(f"{url}/generate", timeout=30, json={
            "text": "The quick brown fox", "sampling_params": {"max_new_tokens": 4},
        })
        assert out.status_code == 200 and out.json()["meta_info"]["completion_tokens"] == 4
        children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(server.pid)],
                                  capture_output=True, text=True).stdout.split()
        assert len(children) == 2  # the scheduler and the detokenizer
    finally:
        server.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert server.wait(15) == 0
        assert time.monotonic() - started < 10
    for pid in children:
        assert not Path(f"/proc/{pid}").exists(), f"child {pid} outlived the server"
