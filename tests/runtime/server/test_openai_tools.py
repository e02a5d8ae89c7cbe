"""Tool calls in ``/v1/chat/completions``, served with the default model and its template
swapped for ``chatml-tools`` (``--chat-template``), asked through real clients: the
``openai`` client (create, ``.stream``, ``.parse``) and LangChain's ``ChatOpenAI``.

A 135M model rarely calls a tool of its own accord, so what must succeed is forced:
``tool_choice`` ``required`` or a named function (the grammar guarantees a call that parses
and validates), or ``auto`` with a regex that writes the calls (to test the reading of
parallel calls in ``auto`` mode, where nothing is forced)."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from live_server import LiveServer
from pydantic import BaseModel, Field

import radixlm
from radixlm.runtime.server.http_server import create_app

pytestmark = pytest.mark.default_model

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "note": {"type": "string", "maxLength": 16},
    },
    "required": ["city", "unit", "days", "note"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "JST"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The forecast",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time",
                                      "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris this week?"}]


@pytest.fixture(scope="module")
def server():
    with radixlm.Engine(max_total_tokens=16384, chat_template="chatml-tools") as engine:
        live = LiveServer(create_app(engine))
        try:
            yield live
        finally:
            live.close()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def assert_valid_calls(calls) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_gives_a_call_that_validates(client, model):
    out = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                         tool_choice="required", parallel_tool_calls=False,
                                         temperature=0, max_tokens=200)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert_valid_calls(choice.message.tool_calls)
    assert len(choice.message.tool_calls) == 1
    assert choice.message.content is None


def test_required_parallel_calls_all_validate(client, model):
    """With parallel calls allowed the model decides how many: this one may repeat calls
    until its tokens run out; every complete call still validates."""
    out = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                         tool_choice="required", temperature=0, max_tokens=120)
    choice = out.choices[0]
    assert choice.finish_reason in ("tool_calls", "length")
    assert_valid_calls(choice.message.tool_calls)
    if choice.finish_reason == "tool_calls":
        assert choice.message.content is None


def test_a_named_function_is_the_one_called(client, model):
    out = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False)
    calls = out.choices[0].message.tool_calls
    assert_valid_calls(calls)
    assert [call.function.name for call in calls] == ["get_time"]


def test_none_leaves_the_tools_out(client, model):
    out = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                         tool_choice="none", temperature=0, max_tokens=16)
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].message.content


def test_streamed_calls_accumulate_to_the_unstreamed_ones(client, model):
    kwargs = {"model": model, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
              "parallel_tool_calls": False, "temperature": 0, "max_tokens": 200}
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    streamed = final.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in streamed] == \
        [(c.function.name, c.function.arguments) for c in whole]
    assert final.choices[0].finish_reason == "tool_calls"


class Forecast(BaseModel):
    city: Literal["Paris", "Tokyo"]
    days: int = Field(ge=1, le=7)


def test_parse_with_a_strict_pydantic_tool(client, model):
    out = client.chat.completions.parse(
        model=model, messages=ASK, temperature=0, max_tokens=100, parallel_tool_calls=False,
        tools=[openai.pydantic_function_tool(Forecast)],
        tool_choice={"type": "function", "function": {"name": "Forecast"}})
    parsed = out.choices[0].message.tool_calls[0].function.parsed_arguments
    assert isinstance(parsed, Forecast)


def test_auto_reads_parallel_calls_the_model_writes(client, model):
    calls = ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {"zone": "JST"}}\n</tool_call>')
    kwargs = {"model": model, "messages": ASK, "tools": TOOLS, "temperature": 0,
              "max_tokens": 80, "extra_body": written("Checking. " + calls)}
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.message.content == "Checking."  # the blank before the calls is dropped
    assert [json.loads(c.function.arguments) for c in whole.message.tool_calls] == \
        [{"zone": "UTC"}, {"zone": "JST"}]
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.message.content == "Checking."
    assert [c.function.arguments for c in final.message.tool_calls] == \
        [c.function.arguments for c in whole.message.tool_calls]
    assert len({c.id for c in final.message.tool_calls}) == 2


def written(calls: str) -> dict:
    """``extra_body`` making the model write ``calls`` (under ``auto`` nothing is forced)."""
    return {"regex": "".join("\\" + c if c in "{}[]().*+?|\\^$" else c for c in calls)}


def test_auto_without_parallel_calls_gives_the_first_call_only(client, model):
    calls = ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {"zone": "JST"}}\n</tool_call>')
    out = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                         parallel_tool_calls=False, temperature=0,
                                         max_tokens=80, extra_body=written(calls))
    message = out.choices[0].message
    assert [json.loads(c.function.arguments) for c in message.tool_calls] == [{"zone": "UTC"}]
    assert message.content is None


def test_a_call_to_a_function_not_offered_is_dropped(client, model):
    calls = ('<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {"zone": "JST"}}\n</tool_call>')
    out = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                         temperature=0, max_tokens=80,
                                         extra_body=written(calls))
    assert [c.function.name for c in out.choices[0].message.tool_calls] == ["get_time"]


def test_auto_with_a_response_format_gives_calls_or_an_answer_of_the_schema(client, model):
    """What the Agents SDK sends for an Agent with tools and an ``output_type``: the output
    is either calls that validate or one JSON value of the format's schema."""
    answer = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": answer}}
    for temperature in (0.0, 1.0):
        out = client.chat.completions.create(
            model=model, messages=ASK, tools=TOOLS, response_format=fmt, n=8,
            temperature=temperature, max_tokens=200, parallel_tool_calls=False)
        for choice in out.choices:
            assert choice.finish_reason in ("tool_calls", "stop"), choice
            if choice.message.tool_calls:
                assert_valid_calls(choice.message.tool_calls)
            else:
                jsonschema.validate(json.loads(choice.message.content), answer)


def test_a_conversation_with_tool_results(client, model):
    first = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                           tool_choice="required", parallel_tool_calls=False,
                                           temperature=0, max_tokens=200).choices[0].message
    history = ASK + [first.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees"}
        for call in first.tool_calls]
    answer = client.chat.completions.create(model=model, messages=history, tools=TOOLS,
                                            temperature=0, max_tokens=24)
    assert answer.choices[0].message.content


@pytest.mark.parametrize(("change", "param"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters":
                                                  {"type": "array"}}}]}, "tools[0].parameters"),
    ({"messages": ASK + [{"role": "tool", "tool_call_id": "call_x", "content": "1"}]},
     "messages[1].tool_call_id"),
    ({"tool_choice": "required", "regex": "a+"}, "regex"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_time",
                                                     "arguments": "[1]"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
])
def test_bad_tool_input_is_a_400_naming_the_field(server, model, change, param):
    body = {"model": model, "messages": ASK, "tools": TOOLS, "max_tokens": 4, **change}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_the_model_path_is_accepted_as_the_model(client, server):
    path = httpx.get(f"{server.url}/get_model_info", timeout=10).json()["model_path"]
    out = client.chat.completions.create(model=path, messages=ASK, max_tokens=2)
    assert out.choices[0].message.content is not None


def test_langchain_bind_tools_gets_tool_calls(server, model):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=model, base_url=f"{server.url}/v1", api_key="x", temperature=0,
                      max_tokens=200, max_retries=0)
    bound = chat.bind_tools(TOOLS, tool_choice="get_weather", parallel_tool_calls=False)
    message = bound.invoke("What is the weather in Paris this week?")
    assert [call["name"] for call in message.tool_calls] == ["get_weather"]
    jsonschema.validate(message.tool_calls[0]["args"], WEATHER)


@pytest.mark.slow
@pytest.mark.parametrize("choice", [  # one call each (see the parallel test above)
    "required", {"type": "function", "function": {"name": "get_weather"}}, "auto-strict"])
def test_200_sampled_requests_all_parse_and_validate(client, model, choice):
    tools = TOOLS
    if choice == "auto-strict":
        tools = [{**tool, "function": {**tool["function"], "strict": True}} for tool in TOOLS]
    kwargs = {"parallel_tool_calls": False}
    if choice != "auto-strict":
        kwargs["tool_choice"] = choice
    called = 0
    for _ in range(4):
        out = client.chat.completions.create(model=model, messages=ASK, tools=tools, n=50,
                                             temperature=1.0, max_tokens=200, **kwargs)
        for sample in out.choices:
            calls = sample.message.tool_calls or []
            if choice != "auto-strict":
                assert sample.finish_reason == "tool_calls", sample
                assert_valid_calls(calls)
            else:
                for call in calls:
                    jsonschema.validate(json.loads(call.function.arguments),
                                        SCHEMAS[call.function.name])
                assert "<tool_call>" not in (sample.message.content or "")
            called += bool(calls)
    assert called == 200 or choice == "auto-strict"
