"""Every event of a stream is one line to any line reader (httpx's ``aiter_lines`` and
Python's ``splitlines`` also end lines at U+0085, U+2028 and U+2029, which JSON lets stand
raw in a string), and each line's JSON holds the event's text unchanged."""

from __future__ import annotations

import asyncio
import json

import httpx
from pydantic import BaseModel

from radixlm.runtime.server.server_sent_events import server_sent_events

TEXTS = ["plain", "a\u2028b", "c\u2029d", "e\x85f", "g\nh\ri", "\u2028", "jump \u00e9\u4e2d"]


class Chunk(BaseModel):
    text: str


async def _events(items):
    for item in items:
        yield item


def _body(items, encode) -> str:
    async def collect() -> bytes:
        source = _events(items)
        return b"".join([part async for part in server_sent_events(
            source, source, encode, lambda err: {"error": str(err)})])

    return asyncio.run(collect()).decode()


def _data_lines(body: str) -> list[str]:
    decoder = httpx._decoders.LineDecoder()  # what aiter_lines splits the body with
    lines = decoder.decode(body) + decoder.flush()
    assert lines == body.splitlines()
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


def test_native_events_are_one_line_each():
    body = _body([{"text": text} for text in TEXTS],
                 lambda chunk: json.dumps(chunk, ensure_ascii=False))
    events = _data_lines(body)
    assert events[-1] == "[DONE]"
    assert [json.loads(event)["text"] for event in events[:-1]] == TEXTS


def test_openai_events_are_one_line_each():
    body = _body([Chunk(text=text) for text in TEXTS], lambda chunk: chunk.model_dump_json())
    events = _data_lines(body)
    assert [json.loads(event)["text"] for event in events[:-1]] == TEXTS
    assert "\u00e9\u4e2d" in body  # other characters stay as they are


def test_named_events_carry_their_name_and_an_error_ends_them_as_an_error_event():
    """Anthropic's and the Responses API's framing: ``event: TYPE`` before each ``data:``,
    no ``[DONE]``; an answered error is an ``error`` event, a fault of ours a StreamFailed."""
    async def failing(error):
        yield {"type": "first", "text": "a\u2028b"}
        raise error

    async def collect(error) -> str:
        source = failing(error)
        parts = [part async for part in server_sent_events(
            source, source, json.dumps, lambda err: {"kind": type(err).__name__},
            event_name=lambda event: event["type"], done=False)]
        return b"".join(parts).decode()

    answered = asyncio.run(collect(ValueError("bad")))
    assert answered.splitlines() == ['event: first', 'data: {"type": "first", "text": '
                                     '"a\\u2028b"}', '', 'event: error',
                                     'data: {"kind": "ValueError"}', '']
    ours = asyncio.run(collect(KeyError("bug")))
    assert ours.endswith('event: error\ndata: {"kind": "StreamFailed"}\n\n')
    assert "[DONE]" not in ours
