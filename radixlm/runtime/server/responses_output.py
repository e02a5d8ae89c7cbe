"""A turn's output as the Responses API's output items, and (streaming) the events that
build them: ``OutputItems`` takes a chat turn's events (``chat_turn.TurnEvent``) in order
and returns, for each, the stream events it causes.

Items are made in the order the turn's events come: a run of reasoning is one ``reasoning``
item, a run of content one ``message`` item (with one ``output_text`` part), each tool call
one ``function_call`` item (ids ``rs_``, ``msg_``, ``fc_``; call ids ``call_``). Whitespace
is the turn's concern: ``TurnStream`` holds content that is only whitespace until text
follows and drops what it still holds at the end of an output with calls, so every content
event here is part of the message. A turn that wrote neither content nor a call still
answers one (empty) message.

Invariants: the items a streamed turn builds (the ``output_item.done`` events, in order)
are the items of the whole turn fed at once, so the streamed and the whole response agree;
every item opened is closed (``output_item.done``) by ``finish``, and every text delta
belongs to the item opened last. Events carry no ``sequence_number``: the writer numbers
them as it sends them.
"""

from __future__ import annotations

import uuid
from typing import Any

from radixlm.runtime.output_parsing.tool_call_types import ToolCall
from radixlm.runtime.server.chat_turn import ContentDelta, ReasoningDelta, TurnEvent

Event = dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """The output items of one turn, built event by event (module docstring)."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the reasoning or message item text joins
        self._text: list[str] = []  # the open item's text pieces

    @property
    def reasoning_text(self) -> str:
        return "".join(part["text"] for item in self.items if item["type"] == "reasoning"
                       for part in item["content"])

    def add(self, event: TurnEvent) -> list[Event]:
        """The stream events ``event`` causes."""
        if isinstance(event, ToolCall):
            return self._close("completed") + self._function_call(event)
        kind = "reasoning" if isinstance(event, ReasoningDelta) else "message"
        assert isinstance(event, (ReasoningDelta, ContentDelta))
        text = event.text
        events = []
        if self._open is None or self._open["type"] != kind:
            events = self._close("completed") + self._start(kind)
        self._text.append(text)
        delta_type = ("response.reasoning_text.delta" if kind == "reasoning"
                      else "response.output_text.delta")
        delta = {"type": delta_type, **self._where(), "content_index": 0, "delta": text}
        if kind == "message":
            delta["logprobs"] = []
        return events + [delta]

    def finish(self, complete: bool) -> list[Event]:
        """Closes the open item (``incomplete`` where the turn was cut short) and makes the
        empty message of a turn that wrote nothing the user sees."""
        status = "completed" if complete else "incomplete"
        events = self._close(status)
        if not any(item["type"] in ("message", "function_call") for item in self.items):
            events += self._start("message") + self._close(status)
        return events

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _start(self, kind: str) -> list[Event]:
        if kind == "reasoning":
            item = {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [],
                    "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"type": "message", "id": new_id("msg"), "role": "assistant",
                    "status": "in_progress", "content": []}
            part = _output_text("")
        self.items.append(item)
        self._open, self._text = item, []
        return [
            {"type": "response.output_item.added", "output_index": len(self.items) - 1,
             "item": _copy(item)},
            {"type": "response.content_part.added", **self._where(), "content_index": 0,
             "part": part},
        ]

    def _close(self, status: str) -> list[Event]:
        item = self._open
        if item is None:
            return []
        text = "".join(self._text)
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            done = {"type": "response.reasoning_text.done", **self._where(), "content_index": 0,
                    "text": text}
        else:
            part = _output_text(text)
            done = {"type": "response.output_text.done", **self._where(), "content_index": 0,
                    "text": text, "logprobs": []}
        item["content"] = [part]
        item["status"] = status
        self._open, self._text = None, []
        return [
            done,
            {"type": "response.content_part.done", **self._where(), "content_index": 0,
             "part": dict(part)},
            {"type": "response.output_item.done", "output_index": len(self.items) - 1,
             "item": _copy(item)},
        ]

    def _function_call(self, call: ToolCall) -> list[Event]:
        item = {"type": "function_call", "id": new_id("fc"), "call_id": new_id("call"),
                "name": call.name, "arguments": "", "status": "in_progress"}
        self.items.append(item)
        added = {"type": "response.output_item.added", "output_index": len(self.items) - 1,
                 "item": _copy(item)}
        item["arguments"], item["status"] = call.arguments, "completed"
        return [
            added,
            {"type": "response.function_call_arguments.delta", **self._where(),
             "delta": call.arguments},
            {"type": "response.function_call_arguments.done", **self._where(),
             "name": call.name, "arguments": call.arguments},
            {"type": "response.output_item.done", "output_index": len(self.items) - 1,
             "item": _copy(item)},
        ]


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """A snapshot of ``item`` (the item changes as the turn goes on)."""
    return {**item, "content": [dict(part) for part in item["content"]]} \
        if "content" in item else dict(item)
