"""The ``radixlm`` command, run as a real subprocess."""

from __future__ import annotations

import argparse
import dataclasses
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from radixlm.cli import add_server_options, server_option_help
from radixlm.runtime.server_args import ServerArgs


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "radixlm.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_every_server_option_has_its_fields_docstring_as_help():
    parser = argparse.ArgumentParser()
    add_server_options(parser)
    helps = {action.dest: action.help for action in parser._actions}
    for field in dataclasses.fields(ServerArgs):
        text, _, default = helps[field.name].rpartition(" (default: ")
        assert default == f"{field.default})".replace("%", "%%")
        words = text.strip(" .").lower()
        assert words and words not in {field.name, field.name.replace("_", " ")}, field.name


def test_server_option_help_is_the_docstrings_first_paragraph_on_one_line():
    helps = server_option_help()
    assert set(helps) == {field.name for field in dataclasses.fields(ServerArgs)}
    assert helps["max_request_parameter_entries"] == (
        "Most stop token ids, logit_bias entries and stop characters of one call's samples "
        "(prompts x n) together: each sample carries its own.")
    for name, text in helps.items():
        assert "``" not in text and "\n" not in text and "  " not in text, name


def test_serve_help_lists_every_option():
    result = run_cli("serve", "--help")
    assert result.returncode == 0, result.stderr
    for field in dataclasses.fields(ServerArgs):
        assert "--" + field.name.replace("_", "-") in result.stdout


def test_generate_streams_a_raw_prompt_through_a_tiny_model(tiny_model_dir):
    path = tiny_model_dir()
    result = run_cli("generate", "The quick brown fox", "--model-path", str(path), "--raw",
                     "--max-new-tokens", "8", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("\n")
    assert len(result.stdout.strip()) > 0


@pytest.mark.slow  # three CLI processes (8 s): CI's last stage
def test_generate_reports_bad_input_without_a_traceback(tiny_model_dir):
    path = tiny_model_dir()
    result = run_cli("generate", "hello", "--model-path", str(path), "--temperature", "-1")
    assert result.returncode == 2
    assert "temperature" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow  # a CLI process loading the real model (~17 s): CI's last stage
@pytest.mark.default_model
def test_readme_command_answers_with_the_default_model():
    result = run_cli("generate", "What is the capital of Japan?", "--max-new-tokens", "32")
    assert result.returncode == 0, result.stderr
    assert "Tokyo" in result.stdout


def test_serve_answers_over_http_and_drains_on_sigterm(tiny_model_dir):
    """The key from the environment guards the routes; on SIGTERM a request in flight still
    gets its whole answer, then the server and its children exit."""
    import os
    import signal
    import threading

    import httpx
    from live_server import wait_healthy

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "radixlm.launch_server", "--model-path", str(tiny_model_dir()),
         "--dtype", "float32", "--max-total-tokens", "2048", "--port", str(port),
         "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "RADIXLM_API_KEY": "test-key"},
    )
    auth = {"Authorization": "Bearer test-key"}
    children = []
    try:
        ready = server.stdout.readline()
        assert f"http://127.0.0.1:{port}" in ready, server.stderr.read()
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, timeout=30)
        body = {"text": "The quick brown fox", "sampling_params": {"max_new_tokens": 4}}
        assert httpx.post(f"{url}/generate", timeout=30, json=body).status_code == 401
        out = httpx.post(f"{url}/generate", timeout=30, json=body, headers=auth)
        assert out.status_code == 200 and out.json()["meta_info"]["completion_tokens"] == 4
        children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(server.pid)],
                                  capture_output=True, text=True).stdout.split()
        assert len(children) == 2  # the scheduler and the detokenizer
        long_body = {"text": "The quick brown fox",
                     "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
        replies = []
        client = threading.Thread(target=lambda: replies.append(
            httpx.post(f"{url}/generate", timeout=60, json=long_body, headers=auth)))
        client.start()
        while httpx.get(f"{url}/get_server_info", headers=auth).json()["num_running"] < 1:
            time.sleep(0.02)
    finally:
        server.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert server.wait(15) == 0
        assert time.monotonic() - started < 10
    client.join(10)
    assert replies[0].status_code == 200
    assert replies[0].json()["meta_info"]["completion_tokens"] == 400
    for pid in children:
        assert not Path(f"/proc/{pid}").exists(), f"child {pid} outlived the server"
