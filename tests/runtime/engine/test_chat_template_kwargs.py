"""A chat request's ``chat_template_kwargs`` set template variables only: a template of the
client's own is refused unless the operator allows it, the rendering's options never pass,
and an allowed client template that renders too long fails its request alone (issue 54,
item 3)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from live_server import LiveServer
from runtime_checks import assert_engine_idle

import radixlm
from radixlm.runtime.engine import engine as engine_module
from radixlm.runtime.engine.chat_template_kwargs import RENDER_OPTIONS, check_template_kwargs
from radixlm.runtime.server.http_server import create_app

CLIENT_TEMPLATE = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
SLOW_TEMPLATE = ("{% for i in range(4000) %}{% for j in range(4000) %}{{ '' }}{% endfor %}"
                 "{% endfor %}x")  # about a second or two of rendering


def chat(url: str, kwargs: dict, stream: bool = False) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "model", "max_tokens": 2, "stream": stream, "chat_template_kwargs": kwargs,
        "messages": [{"role": "user", "content": "hi"}]})


@pytest.fixture(scope="module")
def servers(chat_model_dir):
    """Two servers over the tiny model: the default, and one that trusts client templates."""
    engines = [radixlm.Engine(str(chat_model_dir), dtype="float32", max_total_tokens=2048,
                              trust_request_chat_template=trusted) for trusted in (False, True)]
    lives = [LiveServer(create_app(engine)) for engine in engines]
    yield [(engine, live.url) for engine, live in zip(engines, lives)]
    for live, engine in zip(lives, engines):
        live.close()
        engine.shutdown()


@pytest.mark.parametrize("key", sorted(RENDER_OPTIONS))
def test_no_option_of_the_rendering_passes_as_a_template_variable(key):
    for trusted in (False, True):
        with pytest.raises(ValueError, match=f"may not set \\['{key}'\\]"):
            check_template_kwargs({key: True, "enable_thinking": False}, trusted)


def test_template_variables_pass_and_a_client_template_only_where_trusted():
    assert check_template_kwargs({"enable_thinking": True, "tools": [], "documents": []},
                                 False) is False
    with pytest.raises(ValueError, match="--trust-request-chat-template"):
        check_template_kwargs({"chat_template": CLIENT_TEMPLATE}, False)
    assert check_template_kwargs({"chat_template": CLIENT_TEMPLATE}, True) is True
    with pytest.raises(ValueError, match="must be a string"):
        check_template_kwargs({"chat_template": ["{{ 1 }}"]}, True)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kwargs", [
    {"chat_template": CLIENT_TEMPLATE},
    {"chat_template": "tool_use"},  # a named template is still the client's choice of code
    {"tokenizer_kwargs": {"add_special_tokens": True}},
    {"return_tensors": "pt"},
    {"continue_final_message": True},
])
def test_a_default_server_refuses_templates_and_options_from_a_request(servers, kwargs, stream):
    engine, url = servers[0]
    reply = chat(url, kwargs, stream)
    assert reply.status_code == 400, reply.text
    assert "chat_template_kwargs" in reply.json()["error"]["message"]
    assert_engine_idle(engine)


def test_a_trusting_server_renders_the_clients_template(servers):
    engine, url = servers[1]
    own = chat(url, {}).json()["usage"]["prompt_tokens"]
    theirs = chat(url, {"chat_template": CLIENT_TEMPLATE}).json()["usage"]["prompt_tokens"]
    expected = len(engine.tokenizer.encode("[hi]", add_special_tokens=False))
    assert theirs == expected and own != expected


def test_a_client_template_that_renders_too_long_fails_alone(servers, monkeypatch):
    """Refused after the render timeout (shortened here), while another client is served."""
    engine, url = servers[1]
    monkeypatch.setattr(engine_module, "RENDER_TIMEOUT_S", 0.2)
    answers = {}
    slow = threading.Thread(target=lambda: answers.update(
        slow=chat(url, {"chat_template": SLOW_TEMPLATE})))
    slow.start()
    time.sleep(0.05)
    started = time.monotonic()
    quick = chat(url, {})
    quick_s = time.monotonic() - started
    slow.join(60)
    assert quick.status_code == 200 and quick_s < 5, quick_s
    assert answers["slow"].status_code == 400
    assert "took over 0.2 s to render" in answers["slow"].json()["error"]["message"]
    time.sleep(3)  # the template's thread runs on until it ends
    assert_engine_idle(engine)
