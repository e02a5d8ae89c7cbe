"""OpenAI's Responses API (``/v1/responses``) on a live server over a tiny model, driven by
the official ``openai`` client: text in and out (the chat route's prompt and output),
streams the client's helper assembles into the whole response, forced function calls whose
arguments keep their schema, continuations by ``previous_response_id`` (long chains of
them at linear cost), the store's bounds, a stream an abort ends with ``response.failed``,
and errors in OpenAI's shape naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from fastapi import FastAPI
from live_server import LiveServer

import radixlm
from radixlm.runtime.engine.errors import QueueFull, RuntimeUnavailable
from radixlm.runtime.server.chat_turn import ContentDelta, ReasoningDelta
from radixlm.runtime.server.http_server import create_app
from radixlm.runtime.server.response_store import ResponseStore
from radixlm.runtime.server.responses_api import _failed, _head, add_responses_routes
from radixlm.runtime.server.responses_output import OutputItems
from radixlm.runtime.server.responses_protocol import ResponseObject, ResponsesRequest

MODEL = "tiny"
WEATHER = {
    "type": "function", "name": "get_weather", "description": "The weather in a city.",
    "strict": True,
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}}},
}
TIME = {"type": "function", "name": "get_time", "description": "The time now.",
        "parameters": {"type": "object", "properties": {}}}
GREEDY = {"temperature": 0.0, "max_output_tokens": 8}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    path = tiny_model_dir(max_position_embeddings=4096)  # room for the tools' schemas
    with radixlm.Engine(str(path), dtype="float32", max_total_tokens=8192,
                        chunked_prefill_step_ms=None, disable_adaptive_timing=True,
                        chat_template="chatml-tools", tool_call_parser="qwen25") as engine:
        yield engine


@pytest.fixture(scope="module")
def server(engine):
    server = LiveServer(create_app(engine, served_model_name=MODEL))
    yield server.url
    server.close()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0) as client:
        yield client


def sse_events(url: str, body: dict) -> list[dict]:
    """The events of a streamed response, read off the wire (each ``event:`` line checked
    against its data's ``type``)."""
    events = []
    with httpx.stream("POST", url + "/v1/responses", json=body, timeout=60) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in reply.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: "):]
            elif line.startswith("data: "):
                event = json.loads(line[len("data: "):])
                assert event["type"] == kind
                events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def without_ids(output: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in output]


def test_text_input_answers_what_the_chat_route_answers(client):
    response = client.responses.create(model=MODEL, input="Tell me a story.", **GREEDY)
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0.0,
        messages=[{"role": "user", "content": "Tell me a story."}])
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == (response.usage.input_tokens
                                           + response.usage.output_tokens)
    message = response.output[-1]
    assert message.type == "message" and message.id.startswith("msg_")
    if chat.choices[0].finish_reason == "length":
        assert response.status == "incomplete" and message.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed" and response.incomplete_details is None
    assert response.model == MODEL and response.tools == [] and response.parallel_tool_calls


def test_instructions_and_message_items_are_the_chat_messages(client):
    response = client.responses.create(
        model=MODEL, instructions="Be brief.", **GREEDY,
        input=[{"role": "user", "content": "Hello"},
               {"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": "Hi!", "annotations": []}]},
               {"role": "user", "content": [{"type": "input_text", "text": "Who are you?"}]}])
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0.0,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Hello"},
                  {"role": "assistant", "content": "Hi!"},
                  {"role": "user", "content": "Who are you?"}])
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.instructions == "Be brief."


def test_text_parts_are_joined_by_newlines_as_on_the_chat_route(client):
    parts = [{"type": "input_text", "text": "Hello"}, {"type": "input_text", "text": "there"}]
    response = client.responses.create(model=MODEL, **GREEDY,
                                       input=[{"role": "user", "content": parts}])
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0.0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"},
                                               {"type": "text", "text": "there"}]}])
    joined = client.responses.create(model=MODEL, **GREEDY, input="Hello\nthere")
    assert response.usage.input_tokens == chat.usage.prompt_tokens \
        == joined.usage.input_tokens
    assert response.output_text == chat.choices[0].message.content == joined.output_text


def test_a_text_stream_sends_each_event_in_order_and_its_deltas_make_the_text(server):
    body = {"model": MODEL, "input": "Tell me a story.", "stream": True, **GREEDY}
    events = sse_events(server, body)
    whole = httpx.post(server + "/v1/responses", json={**body, "stream": False},
                       timeout=60).json()
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    final = events[-1]["response"]
    assert deltas == final["output"][-1]["content"][0]["text"] == \
        whole["output"][-1]["content"][0]["text"]
    assert events[-1]["type"] == f"response.{final['status']}"
    assert [e["type"] for e in events if "output_text" not in e["type"]] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.content_part.done",
        "response.output_item.done", f"response.{final['status']}"]
    assert without_ids(final["output"]) == without_ids(whole["output"])
    head = events[0]["response"]
    assert head["id"] == final["id"] and head["status"] == "in_progress"
    assert head["text"] == final["text"] == whole["text"] == {"format": {"type": "text"}}


def test_call_items_are_the_chat_routes_tool_calls_and_results(client):
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
            "arguments": '{"city": "Tokyo"}'}
    items = [{"role": "developer", "content": "Use tools."},
             {"role": "user", "content": "Weather in Tokyo?"},
             {"type": "reasoning", "id": "rs_1", "summary": []}, call,
             {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"}]
    response = client.responses.create(model=MODEL, input=items, tools=[TIME], **GREEDY)
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0.0,
        tools=[{"type": "function", "function": {k: TIME[k] for k in
                                                  ("name", "description", "parameters")}}],
        messages=[{"role": "system", "content": "Use tools."},
                  {"role": "user", "content": "Weather in Tokyo?"},
                  {"role": "assistant", "content": "", "tool_calls": [
                      {"id": "call_1", "type": "function",
                       "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'}}]},
                  {"role": "tool", "content": "Sunny", "tool_call_id": "call_1"}])
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.output_text == (chat.choices[0].message.content or "")


def test_previous_response_id_continues_the_stored_conversation(client):
    call = {"type": "function_call", "call_id": "call_7", "name": "get_time",
            "arguments": "{}"}
    first = client.responses.create(model=MODEL, tools=[TIME], **GREEDY,
                                    input=[{"role": "user", "content": "Time?"}, call])
    answer = {"type": "function_call_output", "call_id": "call_7", "output": "noon"}
    later = client.responses.create(model=MODEL, previous_response_id=first.id,
                                    input=[answer], tools=[TIME], **GREEDY)
    whole = [{"role": "user", "content": "Time?"}, call,
             *[item.model_dump(exclude_none=True) for item in first.output], answer]
    explicit = client.responses.create(model=MODEL, input=whole, tools=[TIME], store=False,
                                       **GREEDY)
    assert later.previous_response_id == first.id
    assert later.output_text == explicit.output_text
    assert later.usage.input_tokens == explicit.usage.input_tokens > first.usage.input_tokens
    assert client.responses.retrieve(later.id).output_text == later.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(explicit.id)  # store: false


def test_the_store_keeps_its_bound_and_forgets_the_least_recent(engine):
    app = FastAPI()
    add_responses_routes(app, engine, MODEL, store=ResponseStore(max_responses=2))
    server = LiveServer(app)
    try:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
            ids = [client.responses.create(model=MODEL, input=f"Say {n}", **GREEDY).id
                   for n in range(3)]
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(ids[0])
            with pytest.raises(openai.BadRequestError) as refused:
                client.responses.create(model=MODEL, input="Go on",
                                        previous_response_id=ids[0], **GREEDY)
            assert refused.value.param == "previous_response_id"
            assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
            client.responses.delete(ids[1])
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(ids[1])
    finally:
        server.close()


def store_server(engine, store: ResponseStore) -> LiveServer:
    app = FastAPI()
    add_responses_routes(app, engine, MODEL, store=store)
    return LiveServer(app)


def test_a_chain_of_thirty_turns_costs_linear_characters_and_continues_whole(engine):
    store = ResponseStore()
    server = store_server(engine, store)
    try:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
            previous, sizes, earlier = None, [], []
            for turn in range(30):
                asked = [{"role": "user", "content": f"Say {turn}"}]
                response = client.responses.create(
                    model=MODEL, input=asked, previous_response_id=previous,
                    temperature=0.0, max_output_tokens=2)
                whole = [*earlier, *asked]  # what the last turn continued, explicitly
                earlier = [*whole, *[item.model_dump(exclude_none=True)
                                     for item in response.output]]
                previous = response.id
                sizes.append(store.chars)
            explicit = client.responses.create(model=MODEL, input=whole, store=False,
                                               temperature=0.0, max_output_tokens=2)
    finally:
        server.close()
    costs = [later - earlier for earlier, later in zip(sizes, sizes[1:])]
    # A turn costs its own items: the 29th link no more than the first (whole conversations
    # stored per turn would make it cost about 29 turns' items more).
    assert max(costs) < 1.2 * min(costs), costs
    assert response.previous_response_id is not None and response.store
    assert response.usage.input_tokens == explicit.usage.input_tokens
    assert response.output_text == explicit.output_text


def test_a_response_too_large_for_the_store_is_answered_as_not_stored(engine):
    server = store_server(engine, ResponseStore(max_chars=300))
    try:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
            response = client.responses.create(model=MODEL, input="hi", **GREEDY)
            with client.responses.stream(model=MODEL, input="hi", **GREEDY) as stream:
                *_, last = stream  # response.completed or (cut short) response.incomplete
            streamed = last.response
            assert response.store is False and streamed.store is False
            for unstored in (response, streamed):
                with pytest.raises(openai.NotFoundError):
                    client.responses.retrieve(unstored.id)
            with pytest.raises(openai.BadRequestError) as refused:
                client.responses.create(model=MODEL, input="Go on",
                                        previous_response_id=response.id, **GREEDY)
            assert refused.value.param == "previous_response_id"
    finally:
        server.close()


def test_an_aborted_stream_ends_with_a_failed_response(client, server):
    request = dict(model=MODEL, input="Tell me a story.", temperature=0.0,
                   max_output_tokens=1500)
    with client.responses.stream(**request) as stream:
        events = iter(stream)
        assert next(events).type == "response.created"  # the generation is under way
        httpx.post(f"{server}/abort_request", json={"abort_all": True}, timeout=60)
        *_, last = events
    assert last.type == "response.failed"
    failed = last.response
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert "aborted" in failed.error.message
    assert failed.usage.output_tokens < 1500
    assert client.responses.retrieve(failed.id).status == "failed"


@pytest.mark.parametrize("error, code", [
    (ValueError("the prompt is too long"), "invalid_request_error"),
    (RuntimeUnavailable("the scheduler died"), "server_error"),
    (QueueFull("too many requests"), "server_error"),
    (KeyError("a fault of ours"), "server_error"),
])
def test_a_stream_an_error_ends_is_a_failed_response_with_openais_code(error, code):
    items = OutputItems()
    items.add(ReasoningDelta("thinking"))
    items.add(ContentDelta("half an ans"))  # closes the reasoning, opens the message
    head = _head(ResponsesRequest(model=MODEL, input="hi"), "resp_1", MODEL)
    failed = _failed(head, items, error)
    ResponseObject.model_validate(failed)
    assert failed["status"] == "failed" and failed["error"]["code"] == code
    assert [item["type"] for item in failed["output"]] == ["reasoning"]  # the finished ones


@pytest.mark.parametrize("extra, param", [
    ({"bogus": 1}, "bogus"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice"),
    ({"tools": [{**TIME, "parameters": {"type": "array"}}]}, "tools[0].parameters"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
     "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"},
                {"role": "user", "content": "hi"}]}, "input[0].arguments"),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
])
def test_bad_requests_are_refused_naming_the_field(server, extra, param):
    body = {"model": MODEL, "input": "hi", **extra}
    reply = httpx.post(server + "/v1/responses", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_another_model_or_an_unknown_response_is_not_found(server, client):
    reply = httpx.post(server + "/v1/responses", json={"model": "gpt-4o", "input": "hi"})
    assert reply.status_code == 404 and reply.json()["error"]["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete("resp_unknown")


def test_json_schema_format_constrains_the_text(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["ok"],
              "properties": {"ok": {"type": "boolean"}}}
    response = client.responses.create(
        model=MODEL, input="Answer in JSON.", temperature=0.0, max_output_tokens=48,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    if response.status == "completed":
        jsonschema.validate(json.loads(response.output_text), schema)
    else:  # cut short: still a prefix the schema allows
        assert response.output_text.lstrip().startswith("{")


@pytest.fixture(scope="module")
def reasoning_server(tiny_model_dir):
    """A server splitting reasoning off as DeepSeek-R1's parser does: the output begins
    inside the reasoning, so all of a tiny model's output (which never closes it) is."""
    with radixlm.Engine(str(tiny_model_dir()), dtype="float32", max_total_tokens=4096,
                        chunked_prefill_step_ms=None, disable_adaptive_timing=True,
                        chat_template="chatml-tools", reasoning_parser="deepseek-r1") as engine:
        app = FastAPI()
        add_responses_routes(app, engine, MODEL)
        server = LiveServer(app)
        yield server.url
        server.close()


def test_reasoning_is_an_item_of_its_own_whole_and_streamed(reasoning_server):
    body = {"model": MODEL, "input": "Think.", **GREEDY}
    whole = httpx.post(reasoning_server + "/v1/responses", json=body, timeout=60).json()
    events = sse_events(reasoning_server, {**body, "stream": True})
    reasoning, message = whole["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["summary"] == [] and reasoning["content"][0]["type"] == "reasoning_text"
    text = reasoning["content"][0]["text"]
    assert text and message["content"][0]["text"] == ""
    assert 0 < whole["usage"]["output_tokens_details"]["reasoning_tokens"] <= 8
    deltas = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(deltas) == text
    assert without_ids(events[-1]["response"]["output"]) == without_ids(whole["output"])
    kinds = [e["type"] for e in events if not e["type"].endswith(".delta")]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.incomplete"]


def test_a_response_format_with_tools_under_auto_is_calls_or_a_value_of_the_schema(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["ok"],
              "properties": {"ok": {"type": "boolean"}}}
    response = client.responses.create(
        model=MODEL, input="Weather?", tools=[WEATHER, TIME], temperature=0.0,
        max_output_tokens=256, parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema,
                         "strict": True}})
    assert response.status == "completed", response.output
    calls = [item for item in response.output if item.type == "function_call"]
    if calls:
        assert [item.type for item in response.output] == ["function_call"]
        [call] = calls
        if call.name == "get_weather":
            jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    else:
        jsonschema.validate(json.loads(response.output_text), schema)


def test_openapi_describes_the_routes(server):
    schema = httpx.get(server + "/openapi.json", timeout=30).json()
    assert {"/v1/responses", "/v1/responses/{response_id}"} <= set(schema["paths"])
    assert {"ResponsesRequest", "ResponseObject"} <= set(schema["components"]["schemas"])


def test_a_forced_call_keeps_its_schema_and_its_stream_assembles_into_the_whole(client):
    request = dict(model=MODEL, input="Weather?", tools=[WEATHER, TIME], temperature=0.0,
                   tool_choice={"type": "function", "name": "get_weather"},
                   parallel_tool_calls=False, max_output_tokens=256)  # tiny vocabulary
    whole = client.responses.create(**request)
    assert whole.status == "completed", whole.output
    with client.responses.stream(**request) as stream:
        types = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert whole.tool_choice.name == "get_weather"
    [call] = whole.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert [item.model_dump(exclude={"id", "call_id", "parsed_arguments"})
            for item in streamed.output] == [
        item.model_dump(exclude={"id", "call_id"}) for item in whole.output]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    assert types.count("response.function_call_arguments.done") == 1
