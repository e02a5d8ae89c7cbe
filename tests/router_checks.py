"""What the tests that run radixlm servers behind SGLang's real router (``smg``) share."""

from __future__ import annotations

import shutil
import subprocess

import httpx
import pytest
from live_server import wait_healthy

NEEDS_SMG = pytest.mark.skipif(shutil.which("smg") is None,
                               reason="sglang-router (the smg command) is not installed")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A ChatML template for the tiny test models (whose tokenizers have none)."""


def wait_until_ready(router: subprocess.Popen, url: str, path: str = "/readiness",
                     timeout: float = 60) -> None:
    """Waits until the router at ``url`` answers ``path`` with 200 (``/readiness``: a
    prefill and a decode worker registered); kills it and fails if it exits or takes
    longer than ``timeout``."""
    try:
        wait_healthy(url, timeout, path, router)
    except AssertionError:
        router.kill()
        raise


def sse_data(reply: httpx.Response) -> list[str]:
    """The ``data:`` payloads of a server-sent-events reply."""
    return [line[len("data: "):] for line in reply.text.splitlines()
            if line.startswith("data: ")]
