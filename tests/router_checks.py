"""What the tests that run radixlm servers behind SGLang's real router (``smg``) share."""

from __future__ import annotations

import shutil
import subprocess
import time

import httpx
import pytest

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
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}{path}", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if router.poll() is not None or time.monotonic() > deadline:
            router.kill()
            raise AssertionError("the router did not become ready")
        time.sleep(0.2)


def sse_data(reply: httpx.Response) -> list[str]:
    """The ``data:`` payloads of a server-sent-events reply."""
    return [line[len("data: "):] for line in reply.text.splitlines()
            if line.startswith("data: ")]
