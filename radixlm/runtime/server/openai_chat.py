"""``/v1/chat/completions``' tools and reasoning: the body as a chat turn (``chat_turn.py``),
and the turn's reading as OpenAI's message or stream of chunks.

A message with calls has ``tool_calls`` (ids ``call_...``), ``content`` null unless the
model wrote text beside them, and ``finish_reason`` ``"tool_calls"`` (where the output
stopped, not where it ran out of tokens). Reasoning split off by ``--reasoning-parser`` is
``reasoning_content``.

Streamed, a choice's chunks are: the opening chunk (``role``), then reasoning, content and
calls as the reader decides them. A call is sent once it is complete, as two chunks: its
index, id, type and name with empty arguments, then the arguments; that is the shape the
``openai`` client's stream accumulator assembles (``client.chat.completions.stream``).
Content that might begin a call is held until decided. Logprobs go with the chunk of the
delta that brought them. With ``stream_reasoning`` false, the reasoning comes whole in the
choice's last chunk.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel

from radixlm.runtime.engine.request_state import OutputDelta
from radixlm.runtime.output_parsing.tool_call_types import FunctionTool, ToolCall
from radixlm.runtime.server.chat_turn import (
    ChatTurn,
    ChatTurnError,
    ContentDelta,
    ReasoningDelta,
    ToolChoice,
    TurnOutput,
    call_arguments,
    check_tool_messages,
    prepare_chat_turn,
)
from radixlm.runtime.server.openai_errors import OpenAIError
from radixlm.runtime.server.openai_outputs import (
    ChoiceProgress,
    chat_logprobs,
    delta_logprobs,
    final_usage,
    finish_type,
)
from radixlm.runtime.server.openai_protocol import (
    AssistantMessage,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    Delta,
    DeltaFunction,
    DeltaToolCall,
    ResponseToolCall,
    ToolCallFunction,
)


async def prepare_openai_chat_turn(engine, body: ChatCompletionRequest,
                                   response_schema: dict[str, Any] | None) -> ChatTurn:
    """The body's chat turn (``response_schema``: its ``response_format``'s); bad input is
    an ``OpenAIError`` 400 naming the field."""
    try:
        messages = [template_message(index, m) for index, m in enumerate(body.messages)]
        tools = [FunctionTool(name=t.function.name, description=t.function.description,
                              strict=bool(t.function.strict),
                              **({} if t.function.parameters is None
                                 else {"parameters": t.function.parameters}))
                 for t in body.tools or ()]
        check_tool_messages(messages)  # (Anthropic's and the Responses API's check their own)
        return await prepare_chat_turn(
            engine, messages, tools=tools, tool_choice=tool_choice(body),
            parallel_tool_calls=body.parallel_tool_calls is not False,
            template_kwargs=body.chat_template_kwargs,
            separate_reasoning=body.separate_reasoning,
            max_reasoning_tokens=body.max_reasoning_tokens, response_schema=response_schema,
        )
    except ChatTurnError as err:
        raise OpenAIError(400, str(err), param=err.param) from None
    except ValueError as err:  # the template refused them, or they are far too long
        raise OpenAIError(400, str(err), param="messages") from None


def tool_choice(body: ChatCompletionRequest) -> ToolChoice:
    """OpenAI's ``tool_choice``: ``auto`` where tools are given, ``none`` where not."""
    choice = body.tool_choice
    if choice is None:
        return ToolChoice("auto" if body.tools else "none")
    if isinstance(choice, str):
        return ToolChoice(choice)
    return ToolChoice("function", choice.function.name)


def template_message(index: int, message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates take it: text content, and an assistant's calls with
    their arguments as a dict (what templates expect; OpenAI sends a JSON string)."""
    content = message.content
    if isinstance(content, list):
        content = "\n".join(part.text for part in content)
    rendered: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.name is not None:
        rendered["name"] = message.name
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        rendered["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name,
                          "arguments": call_arguments(
                              call.function.arguments,
                              f"messages[{index}].tool_calls[{j}].function.arguments")}}
            for j, call in enumerate(message.tool_calls)
        ]
    return rendered


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def assistant_message(read: TurnOutput) -> AssistantMessage:
    calls = [ResponseToolCall(id=new_call_id(),
                              function=ToolCallFunction(name=c.name, arguments=c.arguments))
             for c in read.tool_calls]
    content = read.content if read.content.strip() or not calls else None
    return AssistantMessage(content=content, reasoning_content=read.reasoning,
                            tool_calls=calls or None)


def chat_finish_reason(native: str | None, called: bool) -> str | None:
    """``tool_calls`` for an output that stopped with calls in it, else the native reason."""
    return "tool_calls" if called and native == "stop" else native


class _ChatChoiceStream:
    """One choice's stream: its reader, the calls sent, and reasoning held back."""

    def __init__(self, turn: ChatTurn):
        self.progress = ChoiceProgress()
        self.reader = turn.stream()
        self.calls_sent = 0
        self.held_reasoning = ""


async def chat_stream_events(deltas: AsyncIterator[tuple[int, OutputDelta]],
                             head: dict[str, Any], body: ChatCompletionRequest,
                             turn: ChatTurn) -> AsyncIterator[BaseModel]:
    choices: dict[int, _ChatChoiceStream] = {}
    async for index, delta in deltas:
        state = choices.get(index)
        if state is None:
            state = choices[index] = _ChatChoiceStream(turn)
            opening = ChatChunkChoice(index=index, delta=Delta(role="assistant", content=""))
            yield ChatCompletionChunk(**head, choices=[opening])
        state.progress.advance(delta)
        finish = finish_type(delta.finish_reason)
        events = state.reader.feed(delta.text) if delta.text else []
        if finish is not None:
            events += state.reader.finish()
        deltas_out = [d for event in events for d in _event_deltas(event, state, body)]
        if finish is not None and state.held_reasoning:
            deltas_out.append(Delta(reasoning_content=state.held_reasoning))
        logprobs = chat_logprobs(*delta_logprobs(delta)) if body.logprobs else None
        if logprobs is not None and logprobs.content and not deltas_out:
            deltas_out.append(Delta())
        for position, out in enumerate(deltas_out):
            last = position == len(deltas_out) - 1
            yield ChatCompletionChunk(**head, choices=[ChatChunkChoice(
                index=index, delta=out, logprobs=logprobs if position == 0 else None,
                finish_reason=chat_finish_reason(finish, state.calls_sent > 0)
                if last else None)])
        if finish is not None and not deltas_out:
            yield ChatCompletionChunk(**head, choices=[ChatChunkChoice(
                index=index, delta=Delta(),
                finish_reason=chat_finish_reason(finish, state.calls_sent > 0))])
    if body.stream_options is not None and body.stream_options.include_usage:
        progress = {index: state.progress for index, state in choices.items()}
        yield ChatCompletionChunk(**head, choices=[], usage=final_usage(progress, body.n))


def _event_deltas(event: ReasoningDelta | ContentDelta | ToolCall, state: _ChatChoiceStream,
                  body: ChatCompletionRequest) -> list[Delta]:
    if isinstance(event, ReasoningDelta):
        if body.stream_reasoning:
            return [Delta(reasoning_content=event.text)]
        state.held_reasoning += event.text
        return []
    if isinstance(event, ContentDelta):
        return [Delta(content=event.text)]
    index = state.calls_sent
    state.calls_sent += 1
    opening = DeltaToolCall(index=index, id=new_call_id(), type="function",
                            function=DeltaFunction(name=event.name, arguments=""))
    arguments = DeltaToolCall(index=index, function=DeltaFunction(arguments=event.arguments))
    return [Delta(tool_calls=[opening]), Delta(tool_calls=[arguments])]
