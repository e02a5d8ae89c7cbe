"""Streaming responses as server-sent events, shared by every API: SGLang's native and
OpenAI's chat and completions (``data:`` lines, then ``data: [DONE]``), Anthropic's Messages
and OpenAI's Responses (``event: TYPE`` before each ``data:``, no ``[DONE]``)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from radixlm.runtime.engine.errors import QueueFull, RuntimeUnavailable

logger = logging.getLogger(__name__)


class StreamFailed(Exception):
    """An event stream ended by an error of the server's own (not of the request)."""


# Characters JSON lets stand raw inside a string that line readers (Python's splitlines,
# httpx's aiter_lines) take for a line's end: an event holding one would reach such a client
# cut in two. Escaped, the JSON means the same.
_LINE_BREAKS_IN_JSON = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028",
                                      "\u2029": "\\u2029"})


ANSWERED_IN_STREAMS = (ValueError, RuntimeUnavailable, QueueFull)
"""The errors a stream answers as the request's (any other is a fault of the server's own)."""


async def server_sent_events(
    events: AsyncIterator[Any], source: AsyncIterator[Any],
    encode: Callable[[Any], str], error_body: Callable[[Exception], dict], *,
    event_name: Callable[[Any], str] | None = None, done: bool = True,
    answered: tuple[type[Exception], ...] = ANSWERED_IN_STREAMS,
) -> AsyncIterator[bytes]:
    """``data: <encode(event)>`` per event (U+0085, U+2028 and U+2029 escaped, so that every
    event is one line to any line reader), after ``event: <event_name(event)>`` where the API
    names its events; an error as ``data: <error_body(err)>`` (named ``error``), which ends
    the stream: an ``answered`` one as it is, any other as ``StreamFailed``; then, with
    ``done``, ``data: [DONE]``.

    ``source`` is the Engine stream the events come from. It is closed as soon as this
    iterator ends, which aborts what is unfinished when a client goes away.
    """
    def frame(name: str | None, data: str) -> bytes:
        head = "" if event_name is None else f"event: {name}\n"
        return f"{head}data: {data.translate(_LINE_BREAKS_IN_JSON)}\n\n".encode()

    try:
        async for event in events:
            yield frame(event_name and event_name(event), encode(event))
    except answered as err:
        yield frame("error", json.dumps(error_body(err)))
    except Exception as err:  # a fault of ours: the client still sees the stream end
        logger.exception("a stream failed")
        failure = StreamFailed(f"the server failed ({type(err).__name__}); see its log")
        yield frame("error", json.dumps(error_body(failure)))
    finally:
        await source.aclose()  # at once, not when garbage collected
    if done:
        yield b"data: [DONE]\n\n"
