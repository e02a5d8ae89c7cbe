"""The ``radixlm`` command, run as a real subprocess."""

from __future__ import annotations

import subprocess
import sys

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
    result = run_cli("generate", "What is the capital of France?", "--max-new-tokens", "32")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
