"""A chat request's ``chat_template_kwargs`` set template variables only: a template of the
client's own is refused unless the operator allows it, the rendering's options never pass,
and an allowed client template that renders too long fails its request alone (issue 54,
item 3). A client's template renders in a worker process with a time and a memory bound,
and the worker's death fails that request alone."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import httpx
import pytest
from live_server import LiveServer
from runtime_checks import assert_engine_idle

import radixlm
from radixlm.runtime.engine.chat_template_kwargs import RENDER_OPTIONS, check_template_kwargs
from radixlm.runtime.engine.client_template_renderer import ClientTemplateRenderer
from radixlm.runtime.engine.errors import QueueFull
from radixlm.runtime.server.http_server import create_app

CLIENT_TEMPLATE = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
ENDLESS_TEMPLATES = {
    "loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "loops over a variable": "{% set r = range(100000) %}{% for i in r %}{% for j in r %}"
                             "{% for k in r %}{{ '' }}{% endfor %}{% endfor %}{% endfor %}x",
}
PRINTING_TEMPLATES = {  # past the worker's memory cap in a few hundred steps of 10 MB
    "prints": "{% for i in range(100000) %}{% for j in range(100000) %}"
              "{{ 'x' * 10000000 }}{% endfor %}{% endfor %}",
    "joins": "{% set r = range(100000) %}{{ r | join('x' * 10000000) }}{{ r | join('y') }}",
}


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


def served_while(url: str, kwargs: dict) -> tuple[httpx.Response, float]:
    """The reply to a request with ``kwargs`` and the longest a plain chat request waited
    meanwhile (each must answer 200)."""
    answers, waits = {}, []
    abusive = threading.Thread(target=lambda: answers.update(reply=chat(url, kwargs)))
    abusive.start()
    while abusive.is_alive():
        started = time.monotonic()
        assert chat(url, {}).status_code == 200
        waits.append(time.monotonic() - started)
    abusive.join()
    return answers["reply"], max(waits, default=0.0)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def renderer_worker_pids(engine) -> set[int]:
    worker = engine.client_templates._worker
    return set() if worker is None else {worker.pid}


@pytest.mark.parametrize("kind", sorted(ENDLESS_TEMPLATES))
def test_a_client_template_that_renders_too_long_fails_alone(servers, kind):
    """Refused after the render timeout (shortened here), its worker killed, while other
    clients are served; the next template renders in a fresh worker."""
    engine, url = servers[1]
    engine.client_templates.timeout_s = 1.0
    try:
        reply, worst_wait = served_while(url, {"chat_template": ENDLESS_TEMPLATES[kind]})
    finally:
        engine.client_templates.timeout_s = 10.0
    assert reply.status_code == 400, reply.text
    assert "took over 1.0 s to render" in reply.json()["error"]["message"]
    assert worst_wait < 5, worst_wait
    assert renderer_worker_pids(engine) == set()  # killed
    assert chat(url, {"chat_template": CLIENT_TEMPLATE}).status_code == 200
    assert_engine_idle(engine)


@pytest.mark.slow  # renders until a memory cap: seconds a template
@pytest.mark.parametrize("kind", sorted(PRINTING_TEMPLATES))
def test_a_client_template_that_prints_without_end_fails_on_its_memory_cap(servers, kind):
    engine, url = servers[1]
    before = rss_bytes(os.getpid())
    reply, worst_wait = served_while(url, {"chat_template": PRINTING_TEMPLATES[kind]})
    assert reply.status_code == 400, reply.text
    assert "renderer stopped" in reply.json()["error"]["message"]
    assert worst_wait < 5, worst_wait
    assert rss_bytes(os.getpid()) - before < 200 << 20  # the server's own memory did not grow
    assert chat(url, {"chat_template": CLIENT_TEMPLATE}).status_code == 200
    assert_engine_idle(engine)


@pytest.mark.slow  # a server of its own (8 s): CI's last stage
def test_renders_past_the_waiting_limit_are_refused(chat_model_dir):
    """With the worker held by one endless render, renders past ``max_waiting`` fail at
    once with 503 and the rest wait their turn."""
    renderer = ClientTemplateRenderer(str(chat_model_dir), timeout_s=2.0, max_waiting=2)
    try:
        messages = [{"role": "user", "content": "hi"}]
        results = {}

        def render(name: str, template: str) -> None:
            try:
                results[name] = renderer.render(messages, {"chat_template": template}, 1000)
            except (ValueError, QueueFull) as err:
                results[name] = err

        first = threading.Thread(target=render, args=("endless", ENDLESS_TEMPLATES["loops"]))
        first.start()
        time.sleep(0.5)
        second = threading.Thread(target=render, args=("queued", CLIENT_TEMPLATE))
        second.start()
        time.sleep(0.2)
        render("refused", CLIENT_TEMPLATE)
        first.join(30)
        second.join(30)
        assert isinstance(results["refused"], QueueFull)
        assert isinstance(results["endless"], ValueError)
        assert results["queued"] == "[hi]"
    finally:
        renderer.close()


def test_closing_during_a_render_fails_it_and_stops_the_worker(chat_model_dir):
    renderer = ClientTemplateRenderer(str(chat_model_dir), timeout_s=30.0)
    outcome = {}

    def render() -> None:
        try:
            renderer.render([{"role": "user", "content": "hi"}],
                            {"chat_template": ENDLESS_TEMPLATES["loops"]}, 1000)
        except ValueError as err:
            outcome["error"] = str(err)

    thread = threading.Thread(target=render)
    thread.start()
    time.sleep(3)  # the worker has started and is rendering
    worker = renderer._worker
    started = time.monotonic()
    renderer.close()
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - started < 10
    assert "renderer stopped" in outcome["error"]
    assert worker.poll() is not None  # killed, and reaped by the render's thread
    with pytest.raises(QueueFull, match="shutting down"):
        renderer.render([{"role": "user", "content": "hi"}], {"chat_template": "x"}, 10)


def test_a_reply_of_the_wrong_kind_is_refused(chat_model_dir, tmp_path):
    """A worker (the client's template runs there) that answers a render with a start
    message, or with no text, fails the request with a 400-style error, not a crash."""
    liar = tmp_path / "worker.py"
    liar.write_text("import sys\nprint('{\"ready\": true}', flush=True)\n"
                    "for line in sys.stdin:\n    print('{\"ready\": true}', flush=True)\n")
    renderer = ClientTemplateRenderer(str(chat_model_dir))
    try:
        renderer._stop()
        renderer._worker = subprocess.Popen([sys.executable, str(liar)], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE)
        with pytest.raises(ValueError, match="malformed reply"):
            renderer.render([{"role": "user", "content": "hi"}], {"chat_template": "x"}, 10)
    finally:
        renderer.close()
