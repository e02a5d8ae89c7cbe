"""Values no request may carry are refused where they enter, with a 400 naming the field,
on both APIs, streamed or not: every integer field at 2^63 and 2^64 (a 64-bit integer is
what crosses to the scheduler), template variables of types the chat template cannot take;
and a stream that fails inside the server still ends with an error event and ``[DONE]``.
Afterwards the server is healthy and its pool idle (issue 54, item 5)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from live_server import LiveServer
from runtime_checks import assert_engine_idle

import radixlm
from radixlm.runtime.engine.native_output import NativeOutput
from radixlm.runtime.sampling.sampling_params import SEED_MAX
from radixlm.runtime.server.http_server import create_app

HUGE = [2**63, 2**64]
NATIVE_SAMPLING = ["max_new_tokens", "min_new_tokens", "n", "top_k", "sampling_seed"]
NATIVE_TOP = ["top_logprobs_num", "logprob_start_len"]
OPENAI = {  # field -> the routes that take it
    "max_tokens": ("chat", "completions"), "max_completion_tokens": ("chat",),
    "n": ("chat", "completions"), "seed": ("chat", "completions"),
    "top_k": ("chat", "completions"), "min_tokens": ("chat", "completions"),
    "top_logprobs": ("chat",), "logprobs": ("completions",),
}
NATIVE_NAMES = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens"}
"""OpenAI fields whose refusal may name the native field they become."""


@pytest.fixture(scope="module")
def server(chat_model_dir):
    engine = radixlm.Engine(str(chat_model_dir), dtype="float32", max_total_tokens=4096)
    live = LiveServer(create_app(engine))
    yield engine, live.url
    live.close()
    engine.shutdown()


def answer(url: str, route: str, body: dict) -> tuple[int, str]:
    """The status and body of a request (a stream's whole text)."""
    with httpx.stream("POST", f"{url}{route}", json=body, timeout=60) as response:
        return response.status_code, response.read().decode()


def valid(field: str, value: int) -> bool:
    return field in ("sampling_seed", "seed") and value <= SEED_MAX


def check(engine, status: int, text: str, field: str, value: int) -> None:
    if valid(field, value):
        assert status == 200, text
    else:
        assert status == 400, (field, status, text)
        message = json.loads(text)["error"]["message"]
        assert field in message or NATIVE_NAMES.get(field, field) in message, message
    assert_engine_idle(engine)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("value", HUGE)
@pytest.mark.parametrize("field", NATIVE_SAMPLING + NATIVE_TOP + ["stop_token_ids"])
def test_a_native_integer_beyond_its_range_is_refused_naming_it(server, field, value, stream):
    engine, url = server
    body = {"text": "hi", "stream": stream, "sampling_params": {"max_new_tokens": 4}}
    if field in NATIVE_SAMPLING:
        body["sampling_params"][field] = value
    elif field == "stop_token_ids":
        body["sampling_params"][field] = [value]
    else:
        body.update({field: value, "return_logprob": True})
    check(engine, *answer(url, "/generate", body), field, value)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("value", HUGE)
@pytest.mark.parametrize("route, field", [(route, field) for field, routes in OPENAI.items()
                                          for route in routes])
def test_an_openai_integer_beyond_its_range_is_refused_naming_it(server, route, field, value,
                                                                 stream):
    engine, url = server
    body = {"model": "model", "max_tokens": 4, "stream": stream, field: value}
    if field == "top_logprobs":
        body["logprobs"] = True
    if route == "chat":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    check(engine, *answer(url, f"/v1/{route}/completions" if route == "chat"
                          else "/v1/completions", body), field, value)


def test_min_new_tokens_above_max_new_tokens_is_refused(server):
    engine, url = server
    status, text = answer(url, "/generate", {"text": "hi", "sampling_params": {
        "max_new_tokens": 4, "min_new_tokens": 5}})
    assert status == 400 and "min_new_tokens must be an integer in [0, 4]" in text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kwargs", [{"documents": 5}, {"documents": [3]}, {"tools": 7}])
def test_template_variables_of_types_the_template_cannot_take_are_refused(server, kwargs,
                                                                          stream):
    """transformers' rendering reads ``documents`` and ``tools`` itself, whatever the
    template: values it cannot take are the request's fault, a 400."""
    engine, url = server
    status, text = answer(url, "/v1/chat/completions", {
        "model": "model", "max_tokens": 4, "stream": stream, "chat_template_kwargs": kwargs,
        "messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and "the chat template failed" in text, text
    assert_engine_idle(engine)


def wait_idle(engine, timeout: float = 10) -> None:
    """The pool idle within ``timeout`` seconds (an aborted stream's request ends after its
    client has its last event)."""
    deadline = time.monotonic() + timeout
    while engine.get_server_info()["num_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert_engine_idle(engine)


def failing_after_one(stream_of):
    """Wraps an async iterator factory: the stream gives one item, then the server fails."""
    async def broken(*args, **kwargs):
        source = await stream_of(*args, **kwargs)

        async def items():
            try:
                async for item in source:
                    yield item
                    raise RuntimeError("injected fault")
            finally:
                await source.aclose()
        return items()
    return broken


def events(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def test_an_openai_stream_that_fails_inside_ends_with_an_error_and_done(server, monkeypatch):
    engine, url = server
    monkeypatch.setattr(engine, "stream_deltas", failing_after_one(engine.stream_deltas))
    status, text = answer(url, "/v1/chat/completions", {
        "model": "model", "max_tokens": 64, "ignore_eos": True, "stream": True,
        "messages": [{"role": "user", "content": "hi"}]})
    sent = events(text)
    assert status == 200 and sent[-1] == "[DONE]", text
    error = json.loads(sent[-2])["error"]
    assert error["type"] == "server_error" and "RuntimeError" in error["message"]
    monkeypatch.undo()
    wait_idle(engine)
    assert httpx.get(f"{url}/health").status_code == 200


def test_a_native_stream_that_fails_inside_ends_with_an_error_and_done(server, monkeypatch):
    engine, url = server
    real, calls = NativeOutput.render, []

    def render(output):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("injected fault")
        return real(output)

    monkeypatch.setattr(NativeOutput, "render", render)
    status, text = answer(url, "/generate", {"text": "hi", "stream": True, "sampling_params": {
        "max_new_tokens": 64, "ignore_eos": True}})
    sent = events(text)
    assert status == 200 and sent[-1] == "[DONE]", text
    assert "RuntimeError" in json.loads(sent[-2])["error"]["message"]
    monkeypatch.undo()
    wait_idle(engine)


@pytest.mark.parametrize("sampling", [
    {"n": 2, "use_beam_search": True, "length_penalty": -100},
    {"n": 2, "use_beam_search": True, "length_penalty": 1000},
    {"min_new_tokens": 4, "stop_token_ids": list(range(384))},
    {"n": 2, "use_beam_search": True, "min_new_tokens": 4, "stop_token_ids": list(range(1, 384))},
])
def test_parameters_that_once_failed_a_step_are_refused(server, sampling):
    """(The tiny model's vocabulary is 384 tokens; its EOS stops too, unless ignored.)"""
    engine, url = server
    status, text = answer(url, "/generate", {"text": "hi", "sampling_params": {
        "max_new_tokens": 8, **sampling}})
    assert status == 400 and ("length_penalty" in text or "whole vocabulary" in text), text
    assert_engine_idle(engine)


@pytest.mark.parametrize("messages, refusal", [
    ([{"role": "user"}] * 20_000, "messages"),  # over the count: refused while validated
    ([{"role": "user"}] * 10_000, "characters"),  # no content, still counted
    ([{"role": "user", "content": [{"type": "text", "text": ""}]}] * 5_000, "characters"),
])
def test_chats_are_counted_whole_before_any_rendering(server, messages, refusal):
    engine, url = server
    started = time.monotonic()
    status, text = answer(url, "/v1/chat/completions", {
        "model": "model", "max_tokens": 4, "messages": messages})
    assert status == 400 and refusal in json.loads(text)["error"]["message"], text
    assert time.monotonic() - started < 5
    assert_engine_idle(engine)


def test_stop_token_ids_are_capped_before_they_fan_out_to_samples(server):
    engine, url = server
    status, text = answer(url, "/generate", {"text": "hi", "sampling_params": {
        "max_new_tokens": 4, "n": 16, "stop_token_ids": [5] * 100_000}})
    assert status == 400 and "max_stop_token_ids" in text, text
    status, text = answer(url, "/generate", {"text": ["hi"] * 8, "sampling_params": {
        "max_new_tokens": 4, "n": 64, "stop_token_ids": [5] * 1000}})
    assert status == 400 and "max_request_parameter_entries" in text, text
    status, text = answer(url, "/v1/completions", {
        "model": "model", "prompt": ["hi"] * 8, "max_tokens": 4, "n": 128,
        "logit_bias": {str(t): 1 for t in range(300)}})
    assert status == 400 and "max_request_parameter_entries" in text, text
    assert_engine_idle(engine)
