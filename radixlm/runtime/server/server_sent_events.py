"""Streaming responses as server-sent events, shared by the native and the OpenAI APIs."""

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


async def server_sent_events(
    events: AsyncIterator[Any], source: AsyncIterator[Any],
    encode: Callable[[Any], str], error_body: Callable[[Exception], dict],
) -> AsyncIterator[bytes]:
    """``data: <encode(event)>`` per event (U+0085, U+2028 and U+2029 escaped, so that every
    event is one line to any line reader); an error as ``data: <error_body(err)>``; then
    ``data: [DONE]``.

    ``source`` is the Engine stream the events come from. It is closed as soon as this
    iterator ends, which aborts what is unfinished when a client goes away.
    """
    try:
        async for event in events:
            yield f"data: {encode(event).translate(_LINE_BREAKS_IN_JSON)}\n\n".encode()
    except (ValueError, RuntimeUnavailable, QueueFull) as err:
        yield f"data: {json.dumps(error_body(err))}\n\n".encode()
    except Exception as err:  # a fault of ours: the client still sees the stream end
        logger.exception("a stream failed")
        failure = StreamFailed(f"the server failed ({type(err).__name__}); see its log")
        yield f"data: {json.dumps(error_body(failure))}\n\n".encode()
    finally:
        await source.aclose()  # at once, not when garbage collected
    yield b"data: [DONE]\n\n"
