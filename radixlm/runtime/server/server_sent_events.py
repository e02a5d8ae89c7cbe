"""Streaming responses as server-sent events, shared by the native and the OpenAI APIs."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from radixlm.runtime.engine.errors import QueueFull, RuntimeUnavailable


async def server_sent_events(
    events: AsyncIterator[Any], source: AsyncIterator[Any],
    encode: Callable[[Any], str], error_body: Callable[[Exception], dict],
) -> AsyncIterator[bytes]:
    """``data: <encode(event)>`` per event; an error as ``data: <error_body(err)>``; then
    ``data: [DONE]``.

    ``source`` is the Engine stream the events come from. It is closed as soon as this
    iterator ends, which aborts what is unfinished when a client goes away.
    """
    try:
        async for event in events:
            yield f"data: {encode(event)}\n\n".encode()
    except (ValueError, RuntimeUnavailable, QueueFull) as err:
        yield f"data: {json.dumps(error_body(err))}\n\n".encode()
    finally:
        await source.aclose()  # at once, not when garbage collected
    yield b"data: [DONE]\n\n"
