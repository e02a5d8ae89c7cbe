"""Fixtures of the HTTP server's tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from live_server import LiveServer

from radixlm.runtime.server.http_server import create_app


@pytest.fixture
def live(engine_for):
    """Starts (per call) a real server on 127.0.0.1 over ``engine_for(**options)``; returns
    its URL. The servers stop after the test."""
    servers = []

    def start(**options):
        server = LiveServer(create_app(engine_for(**options)))
        servers.append(server)
        return server.url

    yield start
    for server in servers:
        server.close()


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def chat_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A copy of the tiny model given a chat template (for /v1/chat/completions)."""
    model = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(tiny_model_dir(), model)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return model
