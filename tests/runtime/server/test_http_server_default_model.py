"""A real server on 127.0.0.1 with the default model, asked through the official client."""

from __future__ import annotations

import openai
import pytest
from live_server import LiveServer

import radixlm
from radixlm.runtime.server.http_server import create_app

pytestmark = pytest.mark.default_model


def test_the_default_model_answers_chat_and_native_requests():
    with radixlm.Engine(max_total_tokens=4096) as engine:
        server = LiveServer(create_app(engine))
        try:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
            model = client.models.list().data[0].id
            assert model == "SmolLM2-135M-Instruct"
            chat = client.chat.completions.create(
                model=model, max_tokens=32, temperature=0,
                messages=[{"role": "user", "content": "What is the capital of Japan?"}],
            )
            assert "Tokyo" in chat.choices[0].message.content
            assert chat.choices[0].finish_reason == "stop"
            again = client.chat.completions.create(
                model=model, max_tokens=32, temperature=0,
                messages=[{"role": "user", "content": "What is the capital of Japan?"}],
            )
            assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
        finally:
            server.close()
