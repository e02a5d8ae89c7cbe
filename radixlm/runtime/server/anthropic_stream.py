"""A chat turn's output as Anthropic's message: content blocks, the stream events that build
them, the stop reason, and the events' framing as server-sent events.

``BlockWriter`` takes a turn's events (``chat_turn.TurnEvent``) in order and returns, for
each, the block events it causes: a block starts where the kind of output changes (thinking,
text, a ``tool_use`` per call) and is stopped before the next starts; indexes count up from
0. Whitespace is no concern of the writer: the turn holds whitespace-only content, so a text
block never holds only the blank between two calls.

Invariant: a whole message's content is ``assemble`` of the very block events a stream of
the same output sends (``message_content`` runs the writer over the turn fed the whole
text), so the whole and the streamed message have the same blocks, in the same order, as
far as the turn reads every split of an output alike (``chat_turn.TurnStream``'s promise).

A stream sends ``message_start`` (once the first output arrived, so that its usage is the
prompt's), the block events, then ``message_delta`` (stop reason, final usage) and
``message_stop``: ``event: <type>`` and ``data: <JSON>`` per event, the JSON ASCII-escaped
so every event is one line to any line reader. An error after the stream began (or an
aborted generation) is an ``error`` event, and ends the stream.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Any

from radixlm.runtime.engine.request_state import OutputDelta
from radixlm.runtime.output_parsing.tool_call_types import ToolCall
from radixlm.runtime.server.anthropic_errors import ANSWERED, AnthropicError, as_anthropic_error
from radixlm.runtime.server.anthropic_protocol import (
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessageEnd,
    MessageStart,
    MessageStop,
    OutputBlock,
    StopReason,
    StreamEvent,
    TextDelta,
    TextOut,
    ThinkingDelta,
    ThinkingOut,
    ToolUseOut,
    Usage,
)
from radixlm.runtime.server.chat_turn import ChatTurn, ContentDelta, ReasoningDelta, TurnEvent
from radixlm.runtime.server.server_sent_events import server_sent_events


class BlockWriter:
    """Turns a turn's events into content block events (module docstring). ``called`` says
    whether a ``tool_use`` block was written."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "thinking" or "text": the block taking deltas
        self.called = False

    def take(self, event: TurnEvent) -> list[StreamEvent]:
        """The block events ``event`` causes."""
        if isinstance(event, ReasoningDelta):
            return self._into("thinking") + [
                ContentBlockDelta(index=self.index, delta=ThinkingDelta(thinking=event.text))]
        if isinstance(event, ContentDelta):
            return self._into("text") + [
                ContentBlockDelta(index=self.index, delta=TextDelta(text=event.text))]
        assert isinstance(event, ToolCall)
        self.called = True
        events = self._close()
        self.index += 1
        use = ToolUseOut(id=f"toolu_{uuid.uuid4().hex[:24]}", name=event.name, input={})
        return events + [
            ContentBlockStart(index=self.index, content_block=use),
            ContentBlockDelta(index=self.index, delta=InputJsonDelta(partial_json=event.arguments)),
            ContentBlockStop(index=self.index),
        ]

    def finish(self) -> list[StreamEvent]:
        """Stops the open block, if any."""
        return self._close()

    def _into(self, kind: str) -> list[StreamEvent]:
        if self.open == kind:
            return []
        events = self._close()
        self.index += 1
        self.open = kind
        block = ThinkingOut(thinking="") if kind == "thinking" else TextOut(text="")
        return events + [ContentBlockStart(index=self.index, content_block=block)]

    def _close(self) -> list[StreamEvent]:
        if self.open is None:
            return []
        self.open = None
        return [ContentBlockStop(index=self.index)]


def assemble(events: Iterable[StreamEvent]) -> list[OutputBlock]:
    """The content blocks that block events describe, as a client builds them: each started
    block with its deltas appended (a ``tool_use``'s ``input`` the JSON its deltas join to).
    Other events are passed over."""
    blocks: list[OutputBlock] = []
    partial_json: dict[int, str] = {}
    for event in events:
        if isinstance(event, ContentBlockStart):
            assert event.index == len(blocks), "block indexes count up from 0"
            blocks.append(event.content_block.model_copy())
        elif isinstance(event, ContentBlockDelta):
            block, delta = blocks[event.index], event.delta
            if isinstance(delta, TextDelta):
                block.text += delta.text
            elif isinstance(delta, ThinkingDelta):
                block.thinking += delta.thinking
            else:
                partial_json[event.index] = partial_json.get(event.index, "") + delta.partial_json
    for index, text in partial_json.items():
        blocks[index] = blocks[index].model_copy(update={"input": json.loads(text)})
    return blocks


def message_content(turn: ChatTurn, text: str) -> tuple[list[OutputBlock], bool]:
    """The content blocks of a whole output ``text`` of ``turn``, and whether it called a
    tool: the blocks a stream of the same output builds (module docstring)."""
    writer, reader = BlockWriter(), turn.stream()
    events = [block_event for event in reader.feed(text) + reader.finish()
              for block_event in writer.take(event)]
    return assemble(events + writer.finish()), writer.called


def stop_reason(finish: dict[str, Any] | None, called: bool,
                stop_sequences: list[str]) -> tuple[StopReason, str | None]:
    """Anthropic's stop reason and matched stop sequence for a native finish reason:
    ``max_tokens`` for an output cut off by its length (even one that holds complete calls:
    the model may have had more to say), else ``tool_use`` where it called, else
    ``stop_sequence`` where one of ``stop_sequences`` matched, else ``end_turn``."""
    if finish is not None and finish["type"] == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    matched = finish.get("matched") if finish is not None else None
    if isinstance(matched, str) and matched in stop_sequences:
        return "stop_sequence", matched
    return "end_turn", None


def check_not_aborted(finish: dict[str, Any] | None) -> None:
    """Raises the error answering an aborted generation."""
    if finish is not None and finish["type"] == "abort":
        raise AnthropicError(500, f"the generation was aborted: {finish.get('message', '')}")


def usage(prompt: int, cached: int, output: int) -> Usage:
    """Anthropic's split of the prompt: the tokens not read from the cache, and those that
    were."""
    return Usage(input_tokens=prompt - cached, output_tokens=output,
                 cache_read_input_tokens=cached)


async def stream_events(deltas: AsyncIterator[tuple[int, OutputDelta]], turn: ChatTurn,
                        head: dict[str, Any], stop_sequences: list[str]
                        ) -> AsyncIterator[StreamEvent]:
    """The stream events of the Engine's ``deltas`` of one output; ``head`` is the
    message's ``id`` and ``model``."""
    writer, reader = BlockWriter(), turn.stream()
    prompt = cached = output = 0
    finish, started = None, False
    async for _, delta in deltas:
        if not started:
            started = True
            prompt, cached = delta.prompt_tokens, delta.cached_tokens
            yield MessageStart(message=Message(**head, content=[],
                                               usage=usage(prompt, cached, 0)))
        output += len(delta.new_ids)
        finish = delta.finish_reason or finish
        for event in reader.feed(delta.text):
            for block_event in writer.take(event):
                yield block_event
    check_not_aborted(finish)
    for event in reader.finish():
        for block_event in writer.take(event):
            yield block_event
    for block_event in writer.finish():
        yield block_event
    reason, sequence = stop_reason(finish, writer.called, stop_sequences)
    yield MessageDelta(delta=MessageEnd(stop_reason=reason, stop_sequence=sequence),
                       usage=usage(prompt, cached, output))
    yield MessageStop()


def anthropic_sse(events: AsyncIterator[StreamEvent], source: AsyncIterator
                  ) -> AsyncIterator[bytes]:
    """The events as server-sent events named by their type; an error as an ``error``
    event, which ends them (``server_sent_events``, where ``source`` is closed)."""
    return server_sent_events(
        events, source, lambda event: json.dumps(event.model_dump(mode="json")),
        lambda err: as_anthropic_error(err).body(), event_name=lambda event: event.type,
        done=False, answered=ANSWERED)
