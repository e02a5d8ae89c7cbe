"""Anthropic's Messages API, served by a live uvicorn server and driven by the official
``anthropic`` client (and raw HTTP where the client hides the wire format).

The server runs a tiny random model with a ChatML-like template that renders tools and tool
calls, the ``qwen25`` tool-call parser (Hermes' ``<tool_call>`` blocks) and the
``deepseek-v3`` reasoning parser, whose thinking is off unless a request turns it on (the
template switch ``thinking``). A random model writes no tags of its own, so thinking is
produced by a thinking budget: its end tag is forced after ``budget_tokens`` tokens, and all
before it is reasoning. A forced tool's grammar makes every output a valid call.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from live_server import LiveServer
from runtime_checks import assert_engine_idle

import radixlm
from radixlm.runtime.server.anthropic_api import add_anthropic_routes, chat_messages
from radixlm.runtime.server.anthropic_protocol import MessagesRequest
from radixlm.runtime.server.http_server import create_app

MODEL = "tiny"
TEMPLATE = (
    "{% if tools %}<|im_start|>tools\n{% for t in tools %}{{ t['function']['name'] }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if m['tool_calls'] is defined %}{% for c in m['tool_calls'] %}<tool_call>\n"
    "{{ c['function'] | tojson }}\n</tool_call>{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
FORCED = {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather",
                                               "disable_parallel_tool_use": True}}
GREEDY = {"extra_body": {"temperature": 0.0}}
"""The client no longer takes ``temperature`` as an argument (2.17); the API still does."""
ASK = [{"role": "user", "content": "The quick brown fox"}]


@pytest.fixture(scope="module")
def live(tiny_model_dir, tmp_path_factory):
    """(server url, engine): one server for the module."""
    template = tmp_path_factory.mktemp("anthropic") / "tools.jinja"
    template.write_text(TEMPLATE)
    engine = radixlm.Engine(
        str(tiny_model_dir()), dtype="float32", max_total_tokens=8192,
        chunked_prefill_step_ms=None, disable_adaptive_timing=True,
        chat_template=str(template), tool_call_parser="qwen25", reasoning_parser="deepseek-v3")
    app = create_app(engine, served_model_name=MODEL)
    if not any(getattr(route, "path", None) == "/v1/messages" for route in app.routes):
        add_anthropic_routes(app, engine, MODEL)
    server = LiveServer(app)
    yield server.url, engine
    server.close()
    assert_engine_idle(engine)
    engine.shutdown()


@pytest.fixture(scope="module")
def client(live):
    with anthropic.Anthropic(base_url=live[0], api_key="x", max_retries=0) as client:
        yield client


def native_text(live, messages: list[dict], max_tokens: int, **params) -> dict:
    """The native ``/generate`` output (greedy) for the chat prompt of ``messages``."""
    url, engine = live
    ids = engine.tokenizer.encode(engine.apply_chat_template(messages, thinking=False),
                                  add_special_tokens=False)
    sampling = {"max_new_tokens": max_tokens, "temperature": 0.0, **params}
    return httpx.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": sampling},
                      timeout=60).json()


def sse_events(live, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a streamed response, read off the wire."""
    with httpx.stream("POST", f"{live[0]}/v1/messages", json={**body, "stream": True},
                      timeout=60) as response:
        assert response.status_code == 200
        chunks = response.read().decode().split("\n\n")
    events = []
    for chunk in filter(None, chunks):
        name, data = chunk.split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


# Text ----------------------------------------------------------------------------------------


def test_a_text_message_is_the_greedy_output_with_its_usage(client, live):
    expected = native_text(live, ASK, 8)
    out = client.messages.create(model=MODEL, max_tokens=8, **GREEDY, messages=ASK)
    assert out.id.startswith("msg_") and out.type == "message" and out.role == "assistant"
    assert out.model == MODEL
    assert [block.type for block in out.content] == ["text"]
    assert out.content[0].text == expected["text"]
    meta = expected["meta_info"]
    assert out.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
        meta["finish_reason"]["type"]]
    assert out.usage.output_tokens == meta["completion_tokens"]
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == meta["prompt_tokens"]


def test_a_streamed_message_equals_the_whole_one(client):
    whole = client.messages.create(model=MODEL, max_tokens=12, **GREEDY, messages=ASK)
    with client.messages.stream(model=MODEL, max_tokens=12, **GREEDY,
                                messages=ASK) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert (final.usage.input_tokens + final.usage.cache_read_input_tokens
            == whole.usage.input_tokens + whole.usage.cache_read_input_tokens)


def test_the_stream_is_anthropics_event_sequence(live):
    events = sse_events(live, {"model": MODEL, "max_tokens": 6, "messages": ASK})
    names = [name for name, _ in events]
    assert all(data["type"] == name for name, data in events)
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names[1:-2] == ["content_block_start"] + ["content_block_delta"] * (
        len(names) - 5) + ["content_block_stop"]
    assert events[0][1]["message"]["content"] == [] and events[1][1]["index"] == 0
    assert events[-2][1]["usage"]["output_tokens"] == 6
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"


def test_a_stop_sequence_ends_the_message_and_is_named(client, live):
    full = native_text(live, ASK, 12)["text"]
    stop = full[3:5]
    assert stop.strip(), "the tiny model's output needs a visible stop string"
    out = client.messages.create(model=MODEL, max_tokens=12, **GREEDY, messages=ASK,
                                 stop_sequences=[stop])
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == stop
    assert full.startswith(out.content[0].text) and stop not in out.content[0].text
    with client.messages.stream(model=MODEL, max_tokens=12, **GREEDY, messages=ASK,
                                stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


# Tools ---------------------------------------------------------------------------------------


def test_a_forced_tool_is_a_tool_use_whose_input_fits_the_schema(client):
    out = client.messages.create(model=MODEL, max_tokens=120, **GREEDY, messages=ASK,
                                 **FORCED)
    uses = [block for block in out.content if block.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    assert out.stop_reason == "tool_use"


def test_a_streamed_tool_use_is_assembled_from_input_json_deltas(client):
    whole = client.messages.create(model=MODEL, max_tokens=120, **GREEDY, messages=ASK,
                                   **FORCED)
    with client.messages.stream(model=MODEL, max_tokens=120, **GREEDY, messages=ASK,
                                **FORCED) as stream:
        partial = [event.delta.partial_json for event in stream
                   if event.type == "content_block_delta"
                   and event.delta.type == "input_json_delta"]
        final = stream.get_final_message()
    use = next(block for block in final.content if block.type == "tool_use")
    expected = next(block for block in whole.content if block.type == "tool_use")
    assert json.loads("".join(partial)) == use.input == expected.input
    assert use.name == "get_weather" and final.stop_reason == "tool_use"


def test_a_tool_result_continues_the_conversation(client, live):
    first = client.messages.create(model=MODEL, max_tokens=120, **GREEDY, messages=ASK,
                                   **FORCED)
    use = next(block for block in first.content if block.type == "tool_use")
    history = ASK + [
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "18 degrees"}]},
    ]
    out = client.messages.create(model=MODEL, max_tokens=8, **GREEDY, messages=history,
                                 tools=[WEATHER])
    assert out.stop_reason in ("end_turn", "max_tokens", "tool_use") and out.content
    counted = client.messages.count_tokens(model=MODEL, messages=history, tools=[WEATHER])
    rendered = [{"role": "user", "content": ASK[0]["content"]},
                {"role": "assistant", "content": "", "tool_calls": [{
                    "id": use.id, "type": "function",
                    "function": {"name": "get_weather", "arguments": use.input}}]},
                {"role": "tool", "tool_call_id": use.id, "content": "18 degrees"}]
    tools = [{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER["input_schema"],
        "description": WEATHER["description"]}}]
    engine = live[1]
    text = engine.apply_chat_template(rendered, tools=tools, thinking=False)
    assert counted.input_tokens == len(engine.tokenizer.encode(text, add_special_tokens=False))
    assert (out.usage.input_tokens + out.usage.cache_read_input_tokens == counted.input_tokens)


def test_messages_map_to_chat_messages():
    body = MessagesRequest.model_validate({
        "model": MODEL, "max_tokens": 4,
        "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": ""},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}},
                {"type": "tool_use", "id": "toolu_2", "name": "f", "input": {"a": 2}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sun"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": [{"type": "text", "text": "no such city"}]},
                {"type": "text", "text": "And tomorrow?"}]},
        ],
    })
    assert chat_messages(body) == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}},
            {"id": "toolu_2", "type": "function", "function": {"name": "f", "arguments": {"a": 2}}},
        ]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sun"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no such city"},
        {"role": "user", "content": "And tomorrow?"},
    ]


# Thinking ------------------------------------------------------------------------------------


def test_thinking_within_its_budget_is_a_thinking_block(client, live):
    thinking = {"type": "enabled", "budget_tokens": 4}
    out = client.messages.create(model=MODEL, max_tokens=10, **GREEDY, messages=ASK,
                                 thinking=thinking)
    assert [block.type for block in out.content][:1] == ["thinking"]
    assert out.content[0].signature == ""
    end_ids = live[1].tokenizer.encode("</think>", add_special_tokens=False)
    url, engine = live
    ids = engine.tokenizer.encode(engine.apply_chat_template(ASK, thinking=True),
                                  add_special_tokens=False)
    native = httpx.post(f"{url}/generate", timeout=60, json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": 10, "temperature": 0.0, "max_reasoning_tokens": 4,
        "reasoning_end_token_ids": end_ids}}).json()["text"]
    reasoning, _, content = native.partition("</think>")
    assert out.content[0].thinking == reasoning
    assert "".join(block.text for block in out.content[1:]) == content.lstrip("\n")
    with client.messages.stream(model=MODEL, max_tokens=10, **GREEDY, messages=ASK,
                                thinking=thinking) as stream:
        deltas = [event.delta.thinking for event in stream
                  if event.type == "content_block_delta" and event.delta.type == "thinking_delta"]
        final = stream.get_final_message()
    assert "".join(deltas) == reasoning
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in out.content]


# count_tokens and errors ---------------------------------------------------------------------


def test_count_tokens_is_the_prompt_of_the_same_body(client):
    counted = client.messages.count_tokens(model=MODEL, messages=ASK, system="Be brief.")
    out = client.messages.create(model=MODEL, max_tokens=1, messages=ASK, system="Be brief.")
    assert counted.input_tokens == out.usage.input_tokens + out.usage.cache_read_input_tokens
    with_tools = client.messages.count_tokens(model=MODEL, messages=ASK, system="Be brief.",
                                              tools=[WEATHER])
    assert with_tools.input_tokens > counted.input_tokens


def test_the_model_may_be_named_by_its_path_and_no_other_name(client, live):
    path = httpx.get(f"{live[0]}/get_model_info").json()["model_path"]
    assert client.messages.create(model=path, max_tokens=1, messages=ASK).model == path
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="other", max_tokens=1, messages=ASK)
    assert err.value.body["error"]["type"] == "not_found_error"


TOOL_USE = {"role": "assistant", "content": [
    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]}


@pytest.mark.parametrize("change, field", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages.0.content.0.type"),
    ({"messages": ASK + [TOOL_USE, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}]},
     "messages.2.content.0.tool_use_id"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tools": [{**WEATHER, "input_schema": {"type": "string"}}]}, "tools.0.input_schema"),
    ({"tools": [{**WEATHER, "input_schema": ["city"]}]}, "tools.0.input_schema"),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.name"),
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": ASK + [TOOL_USE]}, "messages.1.role"),
    ({"thinking": {"type": "enabled"}}, "thinking"),
    ({"top_n": 3}, "top_n"),
])
def test_bad_input_is_a_400_naming_the_field(live, change, field):
    body = {"model": MODEL, "max_tokens": 4, "messages": ASK, **change}
    body = {key: value for key, value in body.items() if value is not None}
    for stream in (False, True):
        response = httpx.post(f"{live[0]}/v1/messages", json={**body, "stream": stream},
                              timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()
        assert error["type"] == "error"
        assert error["error"]["type"] == "invalid_request_error"
        assert error["error"]["message"].startswith(f"{field}:"), error["error"]["message"]


def test_a_body_that_is_not_json_is_a_400(live):
    response = httpx.post(f"{live[0]}/v1/messages", content=b'{"model": ', timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("body: JSON decode error")


def test_the_client_raises_bad_request_for_a_400(client):
    with pytest.raises(anthropic.BadRequestError, match="tool_choice.name"):
        client.messages.create(model=MODEL, max_tokens=4, messages=ASK, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "nope"})
    with pytest.raises(anthropic.BadRequestError, match="messages.0.content.0.type"):
        client.messages.count_tokens(model=MODEL, messages=[
            {"role": "user", "content": [{"type": "document", "source": {}}]}])


def test_an_aborted_stream_ends_with_an_error_event(client, live):
    assert native_text(live, ASK, 400)["meta_info"]["finish_reason"]["type"] == "length", (
        "the test needs a greedy output that runs to its length")
    with client.messages.stream(model=MODEL, max_tokens=400, messages=ASK, **GREEDY) as stream:
        events = iter(stream)
        assert next(events).type == "message_start"  # the generation is under way
        httpx.post(f"{live[0]}/abort_request", json={"abort_all": True}, timeout=60)
        with pytest.raises(anthropic.APIStatusError, match="aborted") as err:
            for _ in events:
                pass
    assert err.value.body["error"]["type"] == "api_error"


# The default model ---------------------------------------------------------------------------

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def default_client():
    """A client of a server running the default model with the shipped ChatML-with-tools
    template (SmolLM2's own has no tools)."""
    engine = radixlm.Engine(max_total_tokens=4096, chat_template="chatml-tools")
    app = create_app(engine)
    if not any(getattr(route, "path", None) == "/v1/messages" for route in app.routes):
        add_anthropic_routes(app, engine, DEFAULT_MODEL)
    server = LiveServer(app)
    with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0) as client:
        yield client
    server.close()
    engine.shutdown()


@pytest.mark.default_model
@pytest.mark.slow
def test_the_default_model_answers_and_uses_a_tool(default_client):
    client = default_client
    question = [{"role": "user", "content": "What is the capital of Japan?"}]
    answer = client.messages.create(model=DEFAULT_MODEL, max_tokens=32, messages=question,
                                    **GREEDY)
    assert "Tokyo" in answer.content[0].text and answer.stop_reason == "end_turn"
    weather = {"name": "get_weather", "description": "The forecast for a city",
               "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                "required": ["city"]}}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    with client.messages.stream(model=DEFAULT_MODEL, max_tokens=64, messages=ask, **GREEDY,
                                tools=[weather], tool_choice={
                                    "type": "any", "disable_parallel_tool_use": True}) as stream:
        reply = stream.get_final_message()
    call = next(block for block in reply.content if block.type == "tool_use")
    assert call.name == "get_weather" and reply.stop_reason == "tool_use"
    jsonschema.validate(call.input, weather["input_schema"])
    history = ask + [{"role": "assistant", "content": reply.content},
                     {"role": "user", "content": [{"type": "tool_result",
                                                   "tool_use_id": call.id,
                                                   "content": "Sunny, 21 C"}]}]
    final = client.messages.create(model=DEFAULT_MODEL, max_tokens=48, messages=history,
                                   tools=[weather], **GREEDY)
    assert any(block.type == "text" and block.text.strip() for block in final.content)
