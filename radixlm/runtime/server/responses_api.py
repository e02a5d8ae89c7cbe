"""OpenAI's Responses API over an Engine: ``POST /v1/responses`` (streamed or not), ``GET``
and ``DELETE /v1/responses/{id}``.

A request becomes one chat turn (``chat_turn.py``): ``instructions`` is the system message;
the input items are messages (``developer`` as ``system``), ``function_call`` items join
the assistant message before them as its tool calls, ``function_call_output`` items are
``tool`` messages, reasoning items are left out of the prompt. ``previous_response_id``
puts the stored response's conversation and output before the input (its
``instructions`` are not carried over, as OpenAI does). ``text.format`` is the turn's
``response_schema`` (``json_object``: any JSON object): without tools the text is JSON of
the schema; with tools under ``auto``, calls or one JSON value of the schema (what the
OpenAI Agents SDK asks for an agent with tools and an ``output_type``); under ``required``
or a named function, calls only.

A response is ``completed``; ``incomplete`` where the output hit ``max_output_tokens``
(``incomplete_details.reason``); ``failed`` where the generation was aborted (``error``
with ``code`` ``server_error``). With ``store`` (the default) a finished response is kept
in the ``ResponseStore`` (``response_store.py``, its bounds); one too large for the store is
answered with ``store: false``.

Streams are server-sent events framed as OpenAI frames them (``event: TYPE`` then
``data: JSON``), numbered by ``sequence_number`` from 0: ``response.created``,
``response.in_progress``, the items' events (``responses_output.py``), then
``response.completed`` (or ``response.incomplete``, ``response.failed``). An error after
the stream began ends it with ``response.failed``: the response so far, ``status``
``failed``, ``error`` ``{code, message}`` (``invalid_request_error`` for the request's
fault, ``server_error`` otherwise), so a client's stream helper still gets a final
response. Errors before it are OpenAI's error body: 400 naming the field (``param``), 404
for another model or an unknown stored response.
"""

from __future__ import annotations

import itertools
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
from radixlm.runtime.output_parsing.tool_call_types import FunctionTool
from radixlm.runtime.server.chat_turn import (
    ChatTurn,
    ChatTurnError,
    ToolChoice,
    call_arguments,
    prepare_chat_turn,
)
from radixlm.runtime.server.model_names import resolve_model, unknown_model_message
from radixlm.runtime.server.openai_errors import (
    ERROR_RESPONSES,
    OpenAIError,
    OpenAIRoute,
    as_openai_error,
    openai_error_body,
)
from radixlm.runtime.server.response_store import ResponseStore, StoredResponse
from radixlm.runtime.server.responses_output import OutputItems, new_id
from radixlm.runtime.server.responses_protocol import (
    DeletedResponse,
    ResponseObject,
    ResponsesRequest,
    TextParam,
)
from radixlm.runtime.server.server_sent_events import server_sent_events

logger = logging.getLogger(__name__)


def add_responses_routes(app: FastAPI, engine: Engine, served_model_name: str,
                         store: ResponseStore | None = None) -> None:
    """Adds ``/v1/responses`` serving ``engine`` as ``served_model_name``; finished responses
    are kept in ``store`` (a default ``ResponseStore`` when None)."""
    store = ResponseStore() if store is None else store
    too_large_logged = False
    router = APIRouter(prefix="/v1", route_class=OpenAIRoute, tags=["openai"])

    @router.post("/responses", response_model=ResponseObject, responses=ERROR_RESPONSES)
    async def create_response(body: ResponsesRequest):
        known, adapter = resolve_model(engine, body.model, served_model_name)
        if not known:
            raise OpenAIError(404, unknown_model_message(engine, body.model, served_model_name),
                              param="model", code="model_not_found")
        earlier: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            found = store.conversation(body.previous_response_id)
            if found is None:  # never stored, dropped, or a link of its chain dropped
                raise OpenAIError(400, f"Previous response with id "
                                  f"'{body.previous_response_id}' not found.",
                                  param="previous_response_id",
                                  code="previous_response_not_found")
            earlier = found
        own = input_items(body)
        messages = chat_messages(earlier + own, len(earlier), body.instructions)
        turn = await _prepare(engine, body, messages)
        params = _sampling_params(body, turn)
        request = GenerateInput(input_ids=[turn.prompt_ids], sampling_params=params,
                                lora_path=adapter)
        head = _head(body, new_id("resp"), served_model_name)

        def finished(response: dict[str, Any]) -> None:
            """Stores ``response``, or answers it as not stored where it is too large."""
            nonlocal too_large_logged
            if not body.store or store.put(response["id"], StoredResponse(
                    response, own, body.previous_response_id)):
                return
            response["store"] = False
            if not too_large_logged:
                too_large_logged = True
                logger.warning("a response (%s) is larger than the response store's bound "
                               "(%d characters) and was answered with store: false; raise "
                               "max_chars to keep such responses", response["id"],
                               store.max_chars)

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
        finish = meta.get("finish_reason")
        items.finish((finish or {}).get("type") == "stop")
        response = _response(head, items, finish, engine, meta["prompt_tokens"],
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
            arguments = call_arguments(item["arguments"], f"{where}.arguments")
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
    """A message's text; parts are joined by newlines, as the chat and Anthropic routes
    join theirs."""
    return content if isinstance(content, str) else "\n".join(part["text"] for part in content)


async def _prepare(engine: Engine, body: ResponsesRequest,
                   messages: list[dict[str, Any]]) -> ChatTurn:
    tools = [FunctionTool(name=tool.name, description=tool.description,
                          strict=bool(tool.strict),
                          **({} if tool.parameters is None else {"parameters": tool.parameters}))
             for tool in body.tools or []]
    choice = body.tool_choice
    tool_choice = (ToolChoice(choice) if isinstance(choice, str)
                   else ToolChoice("function", choice.name))
    schema = _response_schema(body.text)
    try:
        return await prepare_chat_turn(engine, messages, tools=tools, tool_choice=tool_choice,
                                       parallel_tool_calls=body.parallel_tool_calls,
                                       response_schema=schema)
    except ChatTurnError as err:
        raise OpenAIError(400, str(err), param=err.param) from None
    except ValueError as err:  # the template refused the messages, or they are too long
        raise OpenAIError(400, str(err), param="input") from None


def _sampling_params(body: ResponsesRequest, turn: ChatTurn) -> dict[str, Any]:
    params = {"max_new_tokens": body.max_output_tokens, "temperature": body.temperature,
              "top_p": body.top_p}
    params = {name: value for name, value in params.items() if value is not None}
    # The turn's own (its grammar, special tokens kept for the reader) win.
    return {**params, **turn.sampling_params}


def _response_schema(text: TextParam | None) -> dict[str, Any] | None:
    """``text.format``'s schema: ``json_object`` is any JSON object, ``text`` (or none)
    None."""
    fmt = None if text is None else text.format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    if fmt.schema_ is None:
        raise OpenAIError(400, "text.format json_schema needs a schema",
                          param="text.format.schema")
    return fmt.schema_


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


def _response(head: dict[str, Any], items: OutputItems, finish: dict[str, Any] | None,
              engine: Engine, prompt_tokens: int, completion_tokens: int,
              cached_tokens: int) -> dict[str, Any]:
    """The finished response's JSON; ``finish`` is the native finish reason."""
    reason = (finish or {}).get("type")
    reasoning = items.reasoning_text
    reasoning_tokens = (len(engine.tokenizer.encode(reasoning, add_special_tokens=False))
                        if reasoning else 0)
    response = {
        **head, "output": items.items, "completed_at": int(time.time()),
        "status": {"stop": "completed", "abort": "failed"}.get(reason, "incomplete"),
        "incomplete_details": {"reason": "max_output_tokens"} if reason == "length" else None,
        "usage": {
            "input_tokens": prompt_tokens, "output_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens,
                                                              completion_tokens)},
        },
    }
    if reason == "abort":
        response["error"] = {"code": "server_error", "message": "the generation was aborted: "
                             + (finish or {}).get("message", "")}
    ResponseObject.model_validate(response)  # the shape promised in /openapi.json
    return response


def _failed(head: dict[str, Any], items: OutputItems, err: Exception) -> dict[str, Any]:
    """The response a stream ends with when ``err`` stopped it: the items finished so far,
    ``status`` failed, and the error (its code OpenAI's, never a Python class name)."""
    if isinstance(err, (ValueError, RuntimeUnavailable, QueueFull)):
        error = as_openai_error(err)
        code = "invalid_request_error" if error.status == 400 else "server_error"
        message = error.message
    else:  # a fault of ours: the client still gets a final response
        logger.exception("a responses stream failed")
        code, message = "server_error", f"the server failed ({type(err).__name__}); see its log"
    output = [item for item in items.items if item["status"] != "in_progress"]
    return {**head, "output": output, "status": "failed",
            "error": {"code": code, "message": message}}


async def _stream_events(deltas: AsyncIterator[tuple[int, OutputDelta]], turn: ChatTurn,
                         head: dict[str, Any], engine: Engine,
                         finished) -> AsyncIterator[dict[str, Any]]:
    """The stream's events, unnumbered; ``finished`` gets the final response (not one that
    an error ended: ``response.failed`` with ``_failed``'s response)."""
    yield {"type": "response.created", "response": head}
    yield {"type": "response.in_progress", "response": head}
    items, stream = OutputItems(), turn.stream()
    prompt_tokens = cached_tokens = completion_tokens = 0
    finish = None
    try:
        async for _, delta in deltas:
            prompt_tokens, cached_tokens = delta.prompt_tokens, delta.cached_tokens
            completion_tokens += len(delta.new_ids)
            for event in stream.feed(delta.text) if delta.text else []:
                for item_event in items.add(event):
                    yield item_event
            if delta.finish_reason is not None:
                finish = delta.finish_reason
        for event in stream.finish():
            for item_event in items.add(event):
                yield item_event
        for item_event in items.finish((finish or {}).get("type") == "stop"):
            yield item_event
        response = _response(head, items, finish, engine, prompt_tokens, completion_tokens,
                             cached_tokens)
    except Exception as err:
        yield {"type": "response.failed", "response": _failed(head, items, err)}
        return
    finished(response)
    yield {"type": f"response.{response['status']}", "response": response}


def _framed(events: AsyncIterator[dict[str, Any]],
            source: AsyncIterator) -> AsyncIterator[bytes]:
    """``event: TYPE`` / ``data: JSON`` per event, numbered (``server_sent_events``, which
    closes ``source``, the Engine stream, when this ends: aborting what is unfinished).
    Errors arrive as ``response.failed`` events already; one that escapes is an ``error``
    event in OpenAI's body."""
    numbers = itertools.count()
    return server_sent_events(
        events, source, lambda event: json.dumps({**event, "sequence_number": next(numbers)}),
        lambda err: openai_error_body(as_openai_error(err)), event_name=lambda e: e["type"],
        done=False)
