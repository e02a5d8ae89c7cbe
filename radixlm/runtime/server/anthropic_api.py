"""Anthropic's Messages API over an Engine: ``POST /v1/messages`` (streamed or not) and
``POST /v1/messages/count_tokens``, bodies in ``anthropic_protocol.py``.

A request becomes one chat turn (``chat_turn.py``): ``system`` the system message, a
``tool_use`` block an assistant's tool call, each ``tool_result`` block a ``tool`` message
(``is_error`` results prefixed ``Error: ``), ``thinking`` blocks dropped from the prompt;
``tool_choice`` ``any`` is ``required``, ``tool`` a named function; ``thinking`` sets the
template's thinking switch (on, with ``budget_tokens`` the thinking budget where the server
has a reasoning parser, or off).

The answer's blocks come in the turn's order: thinking, then text and ``tool_use`` blocks as
the model wrote them. Whitespace-only text next to a tool call is no block. ``stop_reason``
is ``tool_use`` when there are calls, else ``max_tokens`` for a length finish,
``stop_sequence`` when one of ``stop_sequences`` matched, else ``end_turn``.

A stream sends ``message_start`` (once the first output arrived, so that its usage is the
prompt's), then for each block ``content_block_start``, its deltas and
``content_block_stop``, then ``message_delta`` (stop reason, final usage) and
``message_stop``: ``event: <type>`` and ``data: <JSON>`` per event, the JSON ASCII-escaped
so every event is one line to any line reader. Blocks never overlap: one is stopped before
the next starts, and indexes count up from 0.

Errors use Anthropic's body, ``{"type": "error", "error": {"type", "message"}}``, the message
naming the field at fault: 400 ``invalid_request_error`` for bad input, 404
``not_found_error`` for a model other than the served one (its name or its path), 503
``overloaded_error`` / ``api_error`` when the queue is full or the runtime is down. An error
after a stream began (or an aborted generation) is an ``error`` event, and ends the stream.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel

from radixlm.runtime.engine.engine import Engine
from radixlm.runtime.engine.errors import QueueFull, RuntimeUnavailable
from radixlm.runtime.engine.request_inputs import GenerateInput
from radixlm.runtime.engine.request_state import OutputDelta
from radixlm.runtime.output_parsing.reasoning_parser import get_reasoning_parser
from radixlm.runtime.output_parsing.tool_call_types import FunctionTool, ToolCall
from radixlm.runtime.server.anthropic_protocol import (
    UNKNOWN_BLOCK,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    CountTokensRequest,
    ErrorResponse,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessageEnd,
    MessagesRequest,
    MessageStart,
    MessageStop,
    OutputBlock,
    StopReason,
    TextBlock,
    TextDelta,
    TextOut,
    ThinkingConfig,
    ThinkingDelta,
    ThinkingOut,
    TokenCount,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseOut,
    Usage,
)
from radixlm.runtime.server.chat_turn import (
    ChatTurn,
    ContentDelta,
    ReasoningDelta,
    ToolChoice,
    TurnEvent,
    prepare_chat_turn,
)

logger = logging.getLogger(__name__)

_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 500: "api_error",
                503: "overloaded_error"}
_ERRORS = {status: {"model": ErrorResponse} for status in _ERROR_TYPES}


class AnthropicError(Exception):
    """An error to answer with Anthropic's error body."""

    def __init__(self, status: int, message: str, kind: str | None = None):
        super().__init__(message)
        self.status, self.message = status, message
        self.kind = kind or _ERROR_TYPES.get(status, "api_error")

    def body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": self.kind, "message": self.message}}


def field_path(loc: tuple) -> str:
    """A validation error's location as a field path (``messages.0.content.1``): the union
    tags, CamelCase by ``anthropic_protocol``'s rule, left out."""
    parts = [str(part) for part in loc
             if part != "body" and not (isinstance(part, str) and part[:1].isupper())]
    return ".".join(parts) or "body"


def as_anthropic_error(err: Exception) -> AnthropicError:
    if isinstance(err, AnthropicError):
        return err
    if isinstance(err, RequestValidationError):
        first = err.errors()[0]
        path, message = field_path(first.get("loc", ())), first.get("msg", "invalid value")
        if first.get("type") == "json_invalid":  # its location is a character offset
            path = "body"
        if first.get("type") == UNKNOWN_BLOCK:
            given = first.get("input")
            kind = given.get("type") if isinstance(given, dict) else None
            path, message = f"{path}.type", f"{message} (got {kind!r})"
        return AnthropicError(400, f"{path}: {message.removeprefix('Value error, ')}")
    if isinstance(err, QueueFull):
        return AnthropicError(503, str(err))
    if isinstance(err, RuntimeUnavailable):
        return AnthropicError(503, str(err), kind="api_error")
    return AnthropicError(400, str(err))


_ANSWERED = (AnthropicError, RequestValidationError, ValueError, RuntimeUnavailable, QueueFull)


class AnthropicRoute(APIRoute):
    """A route answering its own validation, input and runtime errors in Anthropic's shape."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except _ANSWERED as err:
                error = as_anthropic_error(err)
                return JSONResponse(error.body(), status_code=error.status)

        return guarded


def add_anthropic_routes(app: FastAPI, engine: Engine, served_model_name: str) -> None:
    """Adds ``/v1/messages`` and ``/v1/messages/count_tokens`` serving ``engine`` under the
    name ``served_model_name`` (its path, as ``/get_model_info`` reports it, is taken too)."""
    router = APIRouter(prefix="/v1", route_class=AnthropicRoute, tags=["anthropic"])
    names = {served_model_name, str(engine.model_config.path)}

    def check_model(name: str) -> None:
        if name not in names:
            raise AnthropicError(404, f"model: `{name}` does not exist; this server serves "
                                 f"`{served_model_name}`")

    @router.post("/messages", response_model=Message, responses=_ERRORS)
    async def messages(body: MessagesRequest):
        check_model(body.model)
        turn = await _prepare(engine, body)
        request = GenerateInput(input_ids=[turn.prompt_ids],
                                sampling_params={**_sampling_params(body), **turn.sampling_params})
        head = {"id": f"msg_{uuid.uuid4().hex[:24]}", "model": body.model}
        if body.stream:
            deltas = await engine.stream_deltas(request)
            events = _stream_events(deltas, turn, head, body.stop_sequences or [])
            return StreamingResponse(_sse(events, deltas), media_type="text/event-stream")
        out = (await engine.generate_request(request))[0]
        meta = out["meta_info"]
        _check_not_aborted(meta.get("finish_reason"))
        read = turn.read(out["text"])
        blocks: list[OutputBlock] = [ThinkingOut(thinking=read.reasoning)] if read.reasoning else []
        if read.content and (read.content.strip() or not read.tool_calls):
            blocks.append(TextOut(text=read.content))
        blocks += [_tool_use(call) for call in read.tool_calls]
        reason, sequence = _stop_reason(meta.get("finish_reason"), bool(read.tool_calls),
                                        body.stop_sequences or [])
        usage = _usage(meta["prompt_tokens"], meta["cached_tokens"], meta["completion_tokens"])
        return Message(**head, content=blocks, stop_reason=reason, stop_sequence=sequence,
                       usage=usage)

    @router.post("/messages/count_tokens", response_model=TokenCount, responses=_ERRORS)
    async def count_tokens(body: CountTokensRequest) -> TokenCount:
        check_model(body.model)
        turn = await _prepare(engine, body)
        return TokenCount(input_tokens=len(turn.prompt_ids))

    app.include_router(router)


# Requests -> a chat turn ---------------------------------------------------------------------


async def _prepare(engine: Engine, body: CountTokensRequest) -> ChatTurn:
    """The body's chat turn: its prompt and the constraints its tools and thinking add."""
    if not getattr(engine.tokenizer, "chat_template", None):
        raise AnthropicError(400, "messages: this model's tokenizer has no chat template; "
                             "start the server with --chat-template")
    tools = [FunctionTool(name=tool.name, parameters=tool.input_schema,
                          description=tool.description) for tool in body.tools or []]
    choice = body.tool_choice
    if choice is not None and choice.type == "tool" and choice.name not in {
            tool.name for tool in tools}:
        raise AnthropicError(400, f"tool_choice.name: {choice.name!r} is not among the tools "
                             f"({sorted(tool.name for tool in tools)})")
    if choice is not None and choice.type == "any" and not tools:
        raise AnthropicError(400, "tool_choice.type: `any` needs tools")
    modes = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}
    thinking = body.thinking
    return await prepare_chat_turn(
        engine, chat_messages(body), tools=tools,
        tool_choice=ToolChoice(modes[choice.type], choice.name) if choice else ToolChoice(),
        parallel_tool_calls=not (choice and choice.disable_parallel_tool_use),
        template_kwargs=_thinking_switch(engine, thinking),
        # Without a reasoning parser the end of the thinking is unknown: no budget applies.
        max_reasoning_tokens=thinking.budget_tokens
        if thinking is not None and engine.server_args.reasoning_parser else None,
    )


def _thinking_switch(engine: Engine, thinking: ThinkingConfig | None) -> dict[str, bool]:
    """The template variable turning the model's thinking on or off: the server's reasoning
    parser's switch (``enable_thinking`` for Qwen3, ``thinking`` for DeepSeek-V3.1), else
    ``enable_thinking``. Without ``thinking`` the family's default, said explicitly."""
    name = engine.server_args.reasoning_parser
    switch = get_reasoning_parser(name).thinking_switch if name else None
    if thinking is None:
        return {switch: get_reasoning_parser(name).thinking_default} if switch else {}
    return {switch or "enable_thinking": thinking.type != "disabled"}


def chat_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    """The body's conversation as OpenAI-style chat messages (``chat_turn``'s input).

    Checks what the chat template could not: ``tool_use`` only in assistant messages,
    ``tool_result`` only in user messages and answering a ``tool_use`` of the assistant
    message before it, and a user message last (no assistant prefill).
    """
    out: list[dict[str, Any]] = []
    if body.system is not None:
        out.append({"role": "system", "content": _text(body.system)})
    calls: set[str] = set()  # the tool_use ids of the last assistant message
    for i, message in enumerate(body.messages):
        blocks = ([TextBlock(type="text", text=message.content)]
                  if isinstance(message.content, str) else message.content)
        if message.role == "assistant":
            out.append(_assistant_message(blocks, i))
            calls = {call["id"] for call in out[-1].get("tool_calls", [])}
            continue
        texts: list[str] = []
        for j, block in enumerate(blocks):
            if isinstance(block, ToolResultBlock):
                if block.tool_use_id not in calls:
                    raise AnthropicError(400, f"messages.{i}.content.{j}.tool_use_id: "
                                         f"{block.tool_use_id!r} answers no tool_use block of "
                                         "the assistant message before it")
                if texts:
                    out.append({"role": "user", "content": "\n".join(texts)})
                    texts = []
                result = _text(block.content)
                out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": f"Error: {result}" if block.is_error else result})
            elif isinstance(block, TextBlock):
                texts.append(block.text)
            else:
                raise AnthropicError(400, f"messages.{i}.content.{j}.type: a user message "
                                     f"cannot hold a {block.type} block")
        if texts or not blocks:
            out.append({"role": "user", "content": "\n".join(texts)})
        calls = set()
    if body.messages[-1].role != "user":
        raise AnthropicError(400, f"messages.{len(body.messages) - 1}.role: the last message "
                             "must be a user message (an assistant prefill is not supported)")
    return out


def _assistant_message(blocks: list, index: int) -> dict[str, Any]:
    texts, calls = [], []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": block.input}})
        elif isinstance(block, ToolResultBlock):
            raise AnthropicError(400, f"messages.{index}.content.{j}.type: an assistant "
                                 "message cannot hold a tool_result block")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "\n".join(b.text for b in content)


def _sampling_params(body: MessagesRequest) -> dict[str, Any]:
    """The native sampling parameters; what the body leaves out keeps the Engine's default."""
    params = {"max_new_tokens": body.max_tokens, "stop": body.stop_sequences,
              "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k}
    return {key: value for key, value in params.items() if value is not None}


# Outputs -> a message ------------------------------------------------------------------------


def _check_not_aborted(finish: dict[str, Any] | None) -> None:
    if finish is not None and finish["type"] == "abort":
        raise AnthropicError(500, f"the generation was aborted: {finish.get('message', '')}")


def _stop_reason(finish: dict[str, Any] | None, called: bool,
                 stop_sequences: list[str]) -> tuple[StopReason, str | None]:
    """Anthropic's stop reason and matched stop sequence for a native finish reason."""
    if called:
        return "tool_use", None
    if finish is not None and finish["type"] == "length":
        return "max_tokens", None
    matched = finish.get("matched") if finish is not None else None
    if isinstance(matched, str) and matched in stop_sequences:
        return "stop_sequence", matched
    return "end_turn", None


def _usage(prompt: int, cached: int, output: int) -> Usage:
    return Usage(input_tokens=prompt - cached, output_tokens=output,
                 cache_read_input_tokens=cached)


def _tool_use(call: ToolCall) -> ToolUseOut:
    return ToolUseOut(id=f"toolu_{uuid.uuid4().hex[:24]}", name=call.name,
                      input=json.loads(call.arguments))


class BlockWriter:
    """Turns a turn's events into content block events: a block starts when the kind of
    output changes, and stops before the next one starts. Whitespace-only text is held until
    text that is not whitespace follows (it then opens a text block) or the output ends
    without a tool call (it then is one)."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "thinking" or "text": the block taking deltas
        self.held = ""
        self.called = False

    def take(self, event: TurnEvent) -> list[BaseModel]:
        if isinstance(event, ReasoningDelta):
            return self._into("thinking") + [
                ContentBlockDelta(index=self.index, delta=ThinkingDelta(thinking=event.text))]
        if isinstance(event, ContentDelta):
            if self.open != "text" and not event.text.strip():
                self.held += event.text
                return []
            text, self.held = self.held + event.text, ""
            return self._into("text") + [
                ContentBlockDelta(index=self.index, delta=TextDelta(text=text))]
        self.held, self.called = "", True
        events = self._close()
        self.index += 1
        use = _tool_use(event)
        return events + [
            ContentBlockStart(index=self.index, content_block=use.model_copy(update={"input": {}})),
            ContentBlockDelta(index=self.index, delta=InputJsonDelta(partial_json=event.arguments)),
            ContentBlockStop(index=self.index),
        ]

    def finish(self) -> list[BaseModel]:
        events: list[BaseModel] = []
        if self.held and not self.called:
            text, self.held = self.held, ""
            events = self._into("text") + [
                ContentBlockDelta(index=self.index, delta=TextDelta(text=text))]
        return events + self._close()

    def _into(self, kind: str) -> list[BaseModel]:
        if self.open == kind:
            return []
        events = self._close()
        self.index += 1
        self.open = kind
        block = ThinkingOut(thinking="") if kind == "thinking" else TextOut(text="")
        return events + [ContentBlockStart(index=self.index, content_block=block)]

    def _close(self) -> list[BaseModel]:
        if self.open is None:
            return []
        self.open = None
        return [ContentBlockStop(index=self.index)]


async def _stream_events(deltas: AsyncIterator[tuple[int, OutputDelta]], turn: ChatTurn,
                         head: dict[str, Any], stop_sequences: list[str]
                         ) -> AsyncIterator[BaseModel]:
    writer, reader = BlockWriter(), turn.stream()
    prompt = cached = output = 0
    finish, started = None, False
    async for _, delta in deltas:
        if not started:
            started = True
            prompt, cached = delta.prompt_tokens, delta.cached_tokens
            yield MessageStart(message=Message(**head, content=[],
                                               usage=_usage(prompt, cached, 0)))
        output += len(delta.new_ids)
        finish = delta.finish_reason or finish
        for event in reader.feed(delta.text):
            for block_event in writer.take(event):
                yield block_event
    _check_not_aborted(finish)
    for event in reader.finish():
        for block_event in writer.take(event):
            yield block_event
    for block_event in writer.finish():
        yield block_event
    reason, sequence = _stop_reason(finish, writer.called, stop_sequences)
    yield MessageDelta(delta=MessageEnd(stop_reason=reason, stop_sequence=sequence),
                       usage=_usage(prompt, cached, output))
    yield MessageStop()


def _event(kind: str, data: dict[str, Any]) -> bytes:
    # json.dumps escapes every non-ASCII character, U+2028 and U+2029 among them.
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()


async def _sse(events: AsyncIterator[BaseModel], source: AsyncIterator) -> AsyncIterator[bytes]:
    """The events as server-sent events; an error as an ``error`` event, which ends them.
    ``source`` (the Engine stream) is closed as soon as this ends, which aborts what is
    unfinished when a client goes away."""
    try:
        async for event in events:
            yield _event(event.type, event.model_dump(mode="json"))
    except _ANSWERED as err:
        yield _event("error", as_anthropic_error(err).body())
    except Exception as err:  # a fault of ours: the client still sees the stream end
        logger.exception("a stream failed")
        failure = AnthropicError(500, f"the server failed ({type(err).__name__}); see its log")
        yield _event("error", failure.body())
    finally:
        await source.aclose()
