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
