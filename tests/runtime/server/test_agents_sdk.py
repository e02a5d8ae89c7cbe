"""The default model (SmolLM2-135M-Instruct, served with the ``chatml-tools`` template) as
the OpenAI Agents SDK sees it: an ``Agent`` with two function tools run to its final answer
through ``Runner.run``, over the Responses API and over Chat Completions, and one whose
answer is an ``output_type`` (strict tools and a JSON schema in one request: calls or a
value of the schema); and the function calls the SDK relies on, checked through the
``openai`` client (arguments valid for their schema, a stream that assembles into the whole
response).

What must succeed is forced: the first turn's ``tool_choice`` is ``required`` (the SDK then
resets it to ``auto``), and the input opens with one worked exchange (both tools called,
their results, an answer), which the model follows greedily.
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from live_server import LiveServer
from pydantic import BaseModel

import radixlm
from radixlm.runtime.server.http_server import create_app

# The default model serves an agent loop of several turns: CI's last stage (the chat and
# Responses routes it drives are in the default run on a tiny model).
pytestmark = [pytest.mark.default_model, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"
INSTRUCTIONS = "Call both tools, then answer with their results."
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
          "parameters": CITY, "strict": True},
         {"type": "function", "name": "get_time", "description": "The local time in a city.",
          "parameters": CITY, "strict": True}]
EXAMPLE = [
    {"role": "user", "content": "What are the weather and the time in London?"},
    {"type": "function_call", "call_id": "call_a", "name": "get_weather",
     "arguments": '{"city": "London"}'},
    {"type": "function_call", "call_id": "call_b", "name": "get_time",
     "arguments": '{"city": "London"}'},
    {"type": "function_call_output", "call_id": "call_a", "output": "It is raining in London."},
    {"type": "function_call_output", "call_id": "call_b", "output": "It is 9 am in London."},
    {"role": "assistant", "content": "In London it is raining and it is 9 am."},
]
QUESTION = {"role": "user", "content": "What are the weather and the time in Paris?"}


class Report(BaseModel):
    """An agent's ``output_type``: what the tools said."""

    weather: str
    time: str


REPORT_EXAMPLE = [*EXAMPLE[:-1], {
    "role": "assistant",
    "content": '{"weather": "It is raining in London.", "time": "It is 9 am in London."}'}]


@pytest.fixture(scope="module")
def server():
    with radixlm.Engine(max_total_tokens=8192, chat_template="chatml-tools") as engine:
        server = LiveServer(create_app(engine))
        yield server.url
        server.close()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0) as client:
        yield client


def test_a_required_call_writes_arguments_valid_for_the_schema(client):
    response = client.responses.create(
        model=MODEL, instructions=INSTRUCTIONS, input=[QUESTION], tools=TOOLS,
        tool_choice={"type": "function", "name": "get_time"}, parallel_tool_calls=False,
        temperature=0.0, max_output_tokens=64)
    assert response.status == "completed"
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_time"
    jsonschema.validate(json.loads(call.arguments), CITY)


def test_a_stream_of_calls_assembles_into_the_whole_response(client):
    request = dict(model=MODEL, instructions=INSTRUCTIONS, input=[*EXAMPLE, QUESTION],
                   tools=TOOLS, tool_choice="required", temperature=0.0,
                   max_output_tokens=96)
    whole = client.responses.create(**request)
    with client.responses.stream(**request) as stream:
        types = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert [(item.type, item.name) for item in whole.output] == [
        ("function_call", "get_weather"), ("function_call", "get_time")]
    assert [item.model_dump(exclude={"id", "call_id", "parsed_arguments"})
            for item in streamed.output] == [
        item.model_dump(exclude={"id", "call_id"}) for item in whole.output]
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    assert types.count("response.function_call_arguments.done") == 2
    assert types[-1] == "response.completed"


def city_tools(ran: list[tuple[str, str]]) -> list:
    """get_weather and get_time as the SDK's strict function tools, noting each call."""

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        ran.append(("get_weather", city))
        return f"It is sunny in {city}."

    @function_tool
    def get_time(city: str) -> str:
        """The local time in a city."""
        ran.append(("get_time", city))
        return f"It is noon in {city}."

    return [get_weather, get_time]


@pytest.mark.parametrize("model_class", [OpenAIResponsesModel, OpenAIChatCompletionsModel])
def test_an_agent_calls_both_tools_and_answers(server, model_class):
    set_tracing_disabled(True)
    ran: list[tuple[str, str]] = []

    async def run():
        async with openai.AsyncOpenAI(base_url=server + "/v1", api_key="x",
                                      max_retries=0) as client:
            agent = Agent(name="assistant", instructions=INSTRUCTIONS,
                          tools=city_tools(ran), model=model_class(MODEL, client),
                          model_settings=ModelSettings(tool_choice="required",
                                                       temperature=0.0, max_tokens=96))
            return await Runner.run(agent, [*EXAMPLE, QUESTION], max_turns=4)

    result = asyncio.run(run())
    assert sorted(name for name, _ in ran) == ["get_time", "get_weather"]
    assert isinstance(result.final_output, str) and result.final_output.strip()


def test_an_agent_with_strict_tools_and_an_output_type_answers_with_that_type(server):
    set_tracing_disabled(True)
    ran: list[tuple[str, str]] = []

    async def run():
        async with openai.AsyncOpenAI(base_url=server + "/v1", api_key="x",
                                      max_retries=0) as client:
            agent = Agent(name="assistant", instructions=INSTRUCTIONS, output_type=Report,
                          tools=city_tools(ran), model=OpenAIResponsesModel(MODEL, client),
                          model_settings=ModelSettings(tool_choice="required",
                                                       temperature=0.0, max_tokens=96))
            return await Runner.run(agent, [*REPORT_EXAMPLE, QUESTION], max_turns=4)

    result = asyncio.run(run())
    assert sorted(name for name, _ in ran) == ["get_time", "get_weather"]
    assert isinstance(result.final_output, Report), result.final_output
