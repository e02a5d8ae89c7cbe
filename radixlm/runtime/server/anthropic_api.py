"""Anthropic's Messages API over an Engine: ``POST /v1/messages`` (streamed or not) and
``POST /v1/messages/count_tokens``, bodies in ``anthropic_protocol.py``, the output as a
message and its stream in ``anthropic_stream.py``, errors in ``anthropic_errors.py``.

A request becomes one chat turn (``chat_turn.py``): ``system`` the system message, a
``tool_use`` block an assistant's tool call, each ``tool_result`` block a ``tool`` message
(``is_error`` results prefixed ``Error: ``), ``thinking`` blocks dropped from the prompt;
``tool_choice`` ``any`` is ``required``, ``tool`` a named function,
``disable_parallel_tool_use`` no parallel calls; ``thinking`` sets the template's thinking
switch (on, with ``budget_tokens`` the thinking budget where the server has a reasoning
parser, or off). The turn's own sampling parameters (its grammar, its thinking budget) win
over the body's.

Invariant: a whole message is built by the block writer a stream runs, so both have the
same blocks in the same order (``anthropic_stream``'s invariant); a model other than the
served one (its name or its path) is a 404 before any work is done.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import StreamingResponse

from radixlm.runtime.engine.engine import Engine
from radixlm.runtime.engine.request_inputs import GenerateInput
from radixlm.runtime.output_parsing.reasoning_parser import get_reasoning_parser
from radixlm.runtime.output_parsing.tool_call_types import FunctionTool
from radixlm.runtime.server.anthropic_errors import ERROR_RESPONSES, AnthropicError, AnthropicRoute
from radixlm.runtime.server.anthropic_protocol import (
    CountTokensRequest,
    Message,
    MessagesRequest,
    TextBlock,
    ThinkingConfig,
    TokenCount,
    ToolResultBlock,
    ToolUseBlock,
)
from radixlm.runtime.server.anthropic_stream import (
    anthropic_sse,
    check_not_aborted,
    message_content,
    stop_reason,
    stream_events,
    usage,
)
from radixlm.runtime.server.chat_turn import ChatTurn, ToolChoice, prepare_chat_turn
from radixlm.runtime.server.model_names import resolve_model


def add_anthropic_routes(app: FastAPI, engine: Engine, served_model_name: str) -> None:
    """Adds ``/v1/messages`` and ``/v1/messages/count_tokens`` serving ``engine`` under the
    name ``served_model_name`` (its path, as ``/get_model_info`` reports it, is taken too)."""
    router = APIRouter(prefix="/v1", route_class=AnthropicRoute, tags=["anthropic"])

    def check_model(name: str) -> str | None:
        """The LoRA adapter ``name`` asks for (None: the base model)."""
        known, adapter = resolve_model(engine, name, served_model_name)
        if not known:
            raise AnthropicError(404, f"model: `{name}` does not exist; this server serves "
                                 f"`{served_model_name}`")
        return adapter

    @router.post("/messages", response_model=Message, responses=ERROR_RESPONSES)
    async def messages(body: MessagesRequest):
        adapter = check_model(body.model)
        turn = await _prepare(engine, body)
        request = GenerateInput(input_ids=[turn.prompt_ids],
                                sampling_params={**_sampling_params(body), **turn.sampling_params},
                                lora_path=adapter)
        head = {"id": f"msg_{uuid.uuid4().hex[:24]}", "model": body.model}
        stop_sequences = body.stop_sequences or []
        if body.stream:
            deltas = await engine.stream_deltas(request)
            events = stream_events(deltas, turn, head, stop_sequences)
            return StreamingResponse(anthropic_sse(events, deltas),
                                     media_type="text/event-stream")
        out = (await engine.generate_request(request))[0]
        meta = out["meta_info"]
        check_not_aborted(meta.get("finish_reason"))
        blocks, called = message_content(turn, out["text"])
        reason, sequence = stop_reason(meta.get("finish_reason"), called, stop_sequences)
        return Message(**head, content=blocks, stop_reason=reason, stop_sequence=sequence,
                       usage=usage(meta["prompt_tokens"], meta["cached_tokens"],
                                   meta["completion_tokens"]))

    @router.post("/messages/count_tokens", response_model=TokenCount,
                 responses=ERROR_RESPONSES)
    async def count_tokens(body: CountTokensRequest) -> TokenCount:
        check_model(body.model)
        turn = await _prepare(engine, body)
        return TokenCount(input_tokens=len(turn.prompt_ids))

    app.include_router(router)


# Requests -> a chat turn ---------------------------------------------------------------------


async def _prepare(engine: Engine, body: CountTokensRequest) -> ChatTurn:
    """The body's chat turn: its prompt and the constraints its tools and thinking add."""
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
    """An assistant message: its text blocks joined, its ``tool_use`` blocks its calls."""
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
    """A string, or text blocks joined by newlines."""
    return content if isinstance(content, str) else "\n".join(b.text for b in content)


def _sampling_params(body: MessagesRequest) -> dict[str, Any]:
    """The native sampling parameters; what the body leaves out keeps the Engine's default."""
    params = {"max_new_tokens": body.max_tokens, "stop": body.stop_sequences,
              "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k}
    return {key: value for key, value in params.items() if value is not None}
