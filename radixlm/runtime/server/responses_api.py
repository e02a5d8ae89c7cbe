"""OpenAI's Responses API over an Engine: ``POST /v1/responses`` (streamed or not), ``GET``
and ``DELETE /v1/responses/{id}``.

A request becomes one chat turn (``chat_turn.py``): ``instructions`` is the system message;
the input items are messages (``developer`` as ``system``), ``function_call`` items join
the assistant message before them as its tool calls, ``function_call_output`` items are
``tool`` messages, reasoning items are left out of the prompt. ``previous_response_id``
puts the stored response's conversation and output before the input (its
``instructions`` are not carried over, as OpenAI does). ``text.format`` constrains the
output as ``response_format`` does on the chat route; it cannot be combined with a tool
grammar (``tool_choice`` ``required`` or a named function, or a ``strict`` function).

A response is ``completed``, or ``incomplete`` where the output hit ``max_output_tokens``
(``incomplete_details.reason``) or was aborted (no details). With ``store`` (the default)
a finished response is kept in the ``ResponseStore`` (``response_store.py``, its bounds).

Streams are server-sent events framed as OpenAI frames them (``event: TYPE`` then
``data: JSON``), numbered by ``sequence_number`` from 0: ``response.created``,
``response.in_progress``, the items' events (``responses_output.py``), then
``response.completed`` (or ``response.incomplete``). An error after the stream began is an
``error`` event, and the stream ends. Errors before it are OpenAI's error body: 400 naming
the field (``param``), 404 for another model or an unknown stored response.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, StreamingResponse

from radixlm.runtime.engine.engine import Engine
from radixlm.runtime.engine.errors import QueueFull, RuntimeUnavailable
from radixlm.runtime.engine.request_inputs import GenerateInput
from radixlm.runtime.engine.request_state import OutputDelta
from radixlm.runtime.grammar.constraints import CONSTRAINT_KINDS
from radixlm.runtime.output_parsing.tool_call_types import FunctionTool
from radixlm.runtime.server.chat_turn import ChatTurn, ChatTurnError, ToolChoice, prepare_chat_turn
from radixlm.runtime.server.openai_errors import (
    ERROR_RESPONSES,
    OpenAIError,
    OpenAIRoute,
    as_openai_error,
)
from radixlm.runtime.server.response_store import ResponseStore, StoredResponse
from radixlm.runtime.server.responses_output import OutputItems, new_id
from radixlm.runtime.server.responses_protocol import (
    DeletedResponse,
    ResponseObject,
    ResponsesRequest,
    TextParam,
)

logger = logging.getLogger(__name__)

_ERROR_CODES = {400: "invalid_request_error", 503: "server_error"}


def add_responses_routes(app: FastAPI, engine: Engine, served_model_name: str,
                         store: ResponseStore | None = None) -> None:
    """Adds ``/v1/responses`` serving ``engine`` as ``served_model_name``; finished responses
    are kept in ``store`` (a default ``ResponseStore`` when None)."""
    store = ResponseStore() if store is None else store
    router = APIRouter(prefix="/v1", route_class=OpenAIRoute, tags=["openai"])
    model_path = str(engine.model_config.path)

    @router.post("/responses", response_model=ResponseObject, responses=ERROR_RESPONSES)
    async def create_response(body: ResponsesRequest):
        if body.model not in (served_model_name, model_path):
            raise OpenAIError(404, f"The model `{body.model}` does not exist; this server "
                              f"serves `{served_model_name}`", param="model",
                              code="model_not_found")
        earlier: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            previous = store.get(body.previous_response_id)
            if previous is None:
                raise OpenAIError(400, f"Previous response with id "
                                  f"'{body.previous_response_id}' not found.",
                                  param="previous_response_id",
                                  code="previous_response_not_found")
            earlier = previous.conversation + previous.response["output"]
        own = input_items(body)
        conversation = earlier + own
        messages = chat_messages(conversation, len(earlier), body.instructions)
        turn = await _prepare(engine, body, messages)
        params = _sampling_params(body, turn)
        request = GenerateInput(input_ids=[turn.prompt_ids], sampling_params=params)
        head = _head(body, new_id("resp"), served_model_name)

        def finished(response: dict[str, Any]) -> None:
            if body.store:
                store.put(response["id"], StoredResponse(response, conversation))

        if body.stream:
            deltas = await engine.stream_deltas(request)
            events = _stream_events(deltas, turn, head, engine, finished)
            return StreamingResponse(_framed(events, deltas), media_type="text/event-stream")
        out = (await engine.generate_request(request))[0]
        meta = out["meta_info"]
        items = OutputItems()
        stream = turn.stream()
        for event in stream.feed(out["text"]) + stream.finish():
            items.add(event)
        reason = (meta.get("finish_reason") or {}).get("type")
        items.finish(reason == "stop")
        response = _response(head, items, reason, engine, meta["prompt_tokens"],
                             meta["completion_tokens"], meta["cached_tokens"])
        finished(response)
        return JSONResponse(response)  # as built: response_model would add nested nulls

    @router.get("/responses/{response_id}", response_model=ResponseObject,
                responses=ERROR_RESPONSES)
    async def get_response(response_id: str):
        stored = store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return JSONResponse(stored.response)

    @router.delete("/responses/{response_id}", response_model=DeletedResponse,
                   responses=ERROR_RESPONSES)
    async def delete_response(response_id: str) -> DeletedResponse:
        if not store.delete(response_id):
            raise _not_found(response_id)
        return DeletedResponse(id=response_id)

    app.include_router(router)


def _not_found(response_id: str) -> OpenAIError:
    return OpenAIError(404, f"Response with id '{response_id}' not found.",
                       param="response_id", code="response_not_found")


# Requests -> a chat turn --------------------------------------------------------------------


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items (JSON); a string is one user message."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return [item.model_dump(exclude_none=True) for item in body.input]


def chat_messages(items: list[dict[str, Any]], earlier: int,
                  instructions: str | None) -> list[dict[str, Any]]:
    """The chat messages of a conversation's items, of which the first ``earlier`` came
    from a stored response (errors name the request's own ``input[i]``)."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    calls: set[str] = set()
    for position, item in enumerate(items):
        where = f"input[{position - earlier}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": _text(item["content"])})
        elif kind == "function_call":
            try:
                arguments = json.loads(item["arguments"])
            except json.JSONDecodeError:
                arguments = None
            if not isinstance(arguments, dict):
                raise OpenAIError(400, f"{where}.arguments must be the text of a JSON object, "
                                  f"got {item['arguments'][:80]!r}", param=f"{where}.arguments")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            calls.add(item["call_id"])
        elif kind == "function_call_output":
            if item["call_id"] not in calls:
                raise OpenAIError(400, f"{where}: no function_call with call_id "
                                  f"{item['call_id']!r} comes before this output",
                                  param=f"{where}.call_id")
            messages.append({"role": "tool", "content": _text(item["output"]),
                             "tool_call_id": item["call_id"]})
    if not any(message["role"] != "system" for message in messages):
        raise OpenAIError(400, "input has no message to answer", param="input")
    return messages


def _text(content: str | list[dict[str, Any]]) -> str:
    return content if isinstance(content, str) else "".join(part["text"] for part in content)


async def _prepare(engine: Engine, body: ResponsesRequest,
                   messages: list[dict[str, Any]]) -> ChatTurn:
    tools = [FunctionTool(name=tool.name, description=tool.description,
                          parameters=tool.parameters if tool.parameters is not None
                          else {"type": "object", "properties": {}},
                          strict=bool(tool.strict))
             for tool in body.tools or []]
    choice = body.tool_choice
    tool_choice = (ToolChoice(choice) if isinstance(choice, str)
                   else ToolChoice("function", choice.name))
    if not getattr(engine.tokenizer, "chat_template", None):
        raise OpenAIError(400, "this model's tokenizer has no chat template; use "
                          "/v1/completions", param="input")
    try:
        return await prepare_chat_turn(engine, messages, tools=tools, tool_choice=tool_choice,
                                       parallel_tool_calls=body.parallel_tool_calls)
    except ChatTurnError as err:
        raise OpenAIError(400, str(err), param=err.param) from None
    except ValueError as err:  # the template refused the messages, or they are too long
        raise OpenAIError(400, str(err), param="input") from None


def _sampling_params(body: ResponsesRequest, turn: ChatTurn) -> dict[str, Any]:
    params = {"max_new_tokens": body.max_output_tokens, "temperature": body.temperature,
              "top_p": body.top_p}
    params = {name: value for name, value in params.items() if value is not None}
    constraint = _format_constraint(body.text)
    if constraint and any(kind in turn.sampling_params for kind in CONSTRAINT_KINDS):
        raise OpenAIError(400, "text.format cannot be combined with the tools' grammar "
                          "(tool_choice required or a named function, or a strict function)",
                          param="text.format")
    return {**params, **constraint, **turn.sampling_params}


def _format_constraint(text: TextParam | None) -> dict[str, Any]:
    """``text.format`` as a constraint: any JSON object, or JSON valid against a schema."""
    fmt = None if text is None else text.format
    if fmt is None or fmt.type == "text":
        return {}
    if fmt.type == "json_object":
        return {"json_schema": json.dumps({"type": "object"})}
    if fmt.schema_ is None:
        raise OpenAIError(400, "text.format json_schema needs a schema",
                          param="text.format.schema")
    return {"json_schema": json.dumps(fmt.schema_)}


# Engine outputs -> responses ----------------------------------------------------------------


def _head(body: ResponsesRequest, response_id: str, model: str) -> dict[str, Any]:
    """The response's fields known before generation (those the request echoes)."""
    echoed = body.model_dump(include={
        "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
        "temperature", "top_p", "previous_response_id", "user", "store",
    }, mode="json", by_alias=True)
    # As given, without the settings left out (OpenAI echoes no nulls inside these two).
    text, reasoning = (None if part is None else part.model_dump(
        mode="json", by_alias=True, exclude_none=True) for part in (body.text, body.reasoning))
    return {**echoed, "id": response_id, "object": "response", "created_at": int(time.time()),
            "model": model, "tools": echoed["tools"] or [], "metadata": body.metadata or {},
            "text": text or {"format": {"type": "text"}}, "reasoning": reasoning,
            "truncation": body.truncation or "disabled", "output": [], "usage": None,
            "status": "in_progress", "incomplete_details": None, "error": None,
            "completed_at": None}


def _response(head: dict[str, Any], items: OutputItems, reason: str | None, engine: Engine,
              prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """The finished response's JSON; ``reason`` is the native finish type."""
    reasoning = items.reasoning_text
    reasoning_tokens = (len(engine.tokenizer.encode(reasoning, add_special_tokens=False))
                        if reasoning else 0)
    response = {
        **head, "output": items.items, "completed_at": int(time.time()),
        "status": "completed" if reason == "stop" else "incomplete",
        "incomplete_details": {"reason": "max_output_tokens"} if reason == "length" else None,
        "usage": {
            "input_tokens": prompt_tokens, "output_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens,
                                     "cache_write_tokens": prompt_tokens - cached_tokens},
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens,
                                                              completion_tokens)},
        },
    }
    ResponseObject.model_validate(response)  # the shape promised in /openapi.json
    return response


async def _stream_events(deltas: AsyncIterator[tuple[int, OutputDelta]], turn: ChatTurn,
                         head: dict[str, Any], engine: Engine,
                         finished) -> AsyncIterator[dict[str, Any]]:
    """The stream's events, unnumbered; ``finished`` gets the final response."""
    yield {"type": "response.created", "response": head}
    yield {"type": "response.in_progress", "response": head}
    items, stream = OutputItems(), turn.stream()
    prompt_tokens = cached_tokens = completion_tokens = 0
    reason = None
    async for _, delta in deltas:
        prompt_tokens, cached_tokens = delta.prompt_tokens, delta.cached_tokens
        completion_tokens += len(delta.new_ids)
        for event in stream.feed(delta.text) if delta.text else []:
            for item_event in items.add(event):
                yield item_event
        if delta.finish_reason is not None:
            reason = delta.finish_reason["type"]
    for event in stream.finish():
        for item_event in items.add(event):
            yield item_event
    for item_event in items.finish(reason == "stop"):
        yield item_event
    response = _response(head, items, reason, engine, prompt_tokens, completion_tokens,
                         cached_tokens)
    finished(response)
    final = "response.completed" if response["status"] == "completed" else "response.incomplete"
    yield {"type": final, "response": response}


async def _framed(events: AsyncIterator[dict[str, Any]],
                  source: AsyncIterator) -> AsyncIterator[bytes]:
    """``event: TYPE`` / ``data: JSON`` per event, numbered; an error as an ``error`` event.
    ``source`` (the Engine stream) is closed when this ends, aborting what is unfinished."""
    number = 0

    def frame(event: dict[str, Any]) -> bytes:
        nonlocal number
        event = {**event, "sequence_number": number}
        number += 1
        # ensure_ascii: no raw U+2028 or U+0085 for a line reader to split an event at
        return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()

    try:
        async for event in events:
            yield frame(event)
    except (ValueError, RuntimeUnavailable, QueueFull) as err:
        error = as_openai_error(err)  # the code a whole request's error body would carry
        yield frame({"type": "error", "code": error.code or _ERROR_CODES.get(error.status),
                     "message": error.message, "param": error.param})
    except Exception as err:  # a fault of ours: the client still sees the stream end
        logger.exception("a responses stream failed")
        yield frame({"type": "error", "code": "server_error", "param": None,
                     "message": f"the server failed ({type(err).__name__}); see its log"})
    finally:
        await source.aclose()
