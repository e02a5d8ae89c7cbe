"""Long streams cost linear bytes inside the runtime: outputs travel as deltas from the
scheduler to the request tracker, and the OpenAI stream sends deltas on the wire, while
the native stream keeps SGLang's cumulative text (built at the edge).

What is measured is the bytes beyond the generated text, per token inside and per event on
the wire: the text's length depends on the tokens the model picks (and so on the machine's
arithmetic), and the number of events on how many tokens a stream event gathers (and so on
timing); neither says anything about the cost of the framing."""

from __future__ import annotations

import json

import httpx
import pytest
import transformers
from live_server import LiveServer

import radixlm
from radixlm.runtime.server.http_server import create_app

SHORT, LONG = 512, 4096
GROWTH_BOUND = 1.5
"""The framing bytes per token (inside) or per event (on the wire) may grow at most this much
from the short stream to the long one (a cumulative field in each message would grow them
about LONG / SHORT = 8 times)."""


@pytest.fixture(scope="module")
def server(chat_model_dir):
    """A server over the tiny model with a chat template, and the most bytes one of its
    tokens decodes to."""
    model = chat_model_dir
    engine = radixlm.Engine(str(model), dtype="float32", context_length=LONG + 64,
                            max_total_tokens=LONG + 128)
    live = LiveServer(create_app(engine))
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    longest = max(len(tokenizer.decode([token]).encode()) for token in range(len(tokenizer)))
    yield engine, live, longest
    live.close()
    engine.shutdown()


def sse_events(response: httpx.Response) -> tuple[list[dict], list[int]]:
    """The JSON events of a server-sent-event stream, and each one's length on the wire."""
    events, sizes = [], []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: "):]))
            sizes.append(len(line.encode()) + 2)  # and the blank line after it
    return events, sizes


def native_stream(url: str, tokens: int) -> list[dict]:
    body = {"text": "Once upon a time", "stream": True,
            "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=600) as response:
        return sse_events(response)[0]


def chat_stream(url: str, tokens: int) -> tuple[list[dict], list[int]]:
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "stream": True, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "messages": [{"role": "user", "content": "Once upon a time"}]}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        assert response.status_code == 200
        return sse_events(response)


def received_during(engine: radixlm.Engine, run) -> tuple[int, object]:
    before = engine.received_bytes
    result = run()
    return engine.received_bytes - before, result


def chat_text(event: dict) -> str:
    return "".join(choice["delta"].get("content") or "" for choice in event["choices"])


def test_a_native_stream_moves_linear_bytes_and_keeps_cumulative_text(server):
    engine, live, _ = server
    per_token = {}
    for tokens in (SHORT, LONG):
        received, chunks = received_during(
            engine, lambda tokens=tokens: native_stream(live.url, tokens))
        assert chunks[-1]["meta_info"]["completion_tokens"] == tokens
        assert len(chunks[-1]["output_ids"]) == tokens
        # SGLang's native stream: every chunk's text extends the one before.
        for before, after in zip(chunks, chunks[1:]):
            assert after["text"].startswith(before["text"])
        per_token[tokens] = (received - len(chunks[-1]["text"].encode())) / tokens
    assert per_token[LONG] < GROWTH_BOUND * per_token[SHORT], per_token


def test_an_openai_stream_moves_linear_bytes_inside_and_on_the_wire(server):
    engine, live, longest_token = server
    inside, wire = {}, {}
    for tokens in (SHORT, LONG):
        received, (events, sizes) = received_during(
            engine, lambda tokens=tokens: chat_stream(live.url, tokens))
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        texts = [chat_text(event) for event in events]
        text_bytes = sum(len(text.encode()) for text in texts)
        assert text_bytes <= tokens * longest_token  # deltas: no text is sent twice
        inside[tokens] = (received - text_bytes) / tokens
        wire[tokens] = (sum(sizes) - text_bytes) / len(events)
    assert inside[LONG] < GROWTH_BOUND * inside[SHORT], inside
    assert wire[LONG] < GROWTH_BOUND * wire[SHORT], wire


def test_a_server_and_the_engines_own_api_share_the_engine_while_it_runs(engine_for):
    """The RequestTracker stays on the Engine's loop: a server's handlers hop there, and the
    Engine's blocking API works beside them, during and after the server's life."""
    engine = engine_for()
    loop = engine._loop
    live = LiveServer(create_app(engine))
    try:
        body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 4}}
        assert httpx.post(f"{live.url}/generate", json=body, timeout=60).status_code == 200
        assert engine.generate("Once upon a time", {"max_new_tokens": 4})["output_ids"]
    finally:
        live.close()
    assert engine._loop is loop
    assert engine.generate("Once upon a time", {"max_new_tokens": 4})["output_ids"]
