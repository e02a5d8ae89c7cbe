"""OpenAI's error body and the route class answering errors with it, for every route that
speaks OpenAI's API (``openai_api.py``, ``responses_api.py``): ``{"error": {"message",
"type", "param", "code"}}``; 400 for bad input (a body that is not JSON, fails validation,
or that the Engine refuses), 404 for an unknown model or object, 503 when the queue is full
or the runtime is down, and a stream's mid-way error as its last event."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from radixlm.runtime.engine.errors import QueueFull, RuntimeUnavailable
from radixlm.runtime.server.answering_route import answering_route
from radixlm.runtime.server.chat_turn import ChatTurnError
from radixlm.runtime.server.openai_protocol import ErrorResponse
from radixlm.runtime.server.server_sent_events import StreamFailed, server_sent_events

_ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 500: "server_error",
                503: "server_error"}
ERROR_RESPONSES = {status: {"model": ErrorResponse} for status in _ERROR_TYPES}


class OpenAIError(Exception):
    """An error to answer with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def openai_error_body(err: OpenAIError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": _ERROR_TYPES.get(err.status, "error"),
                      "param": err.param, "code": err.code}}


def as_openai_error(err: Exception) -> OpenAIError:
    if isinstance(err, OpenAIError):
        return err
    if isinstance(err, RequestValidationError):
        first = err.errors()[0]
        field = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return OpenAIError(400, f"{field or 'body'}: {first.get('msg', 'invalid value')}",
                           param=field)
    if isinstance(err, ChatTurnError):
        return OpenAIError(400, str(err), param=err.param)
    if isinstance(err, QueueFull):
        return OpenAIError(503, str(err), code="queue_full")
    if isinstance(err, RuntimeUnavailable):
        return OpenAIError(503, str(err))
    if isinstance(err, StreamFailed):
        return OpenAIError(500, str(err))
    return OpenAIError(400, str(err))


_ANSWERED = (OpenAIError, RequestValidationError, ValueError, RuntimeUnavailable, QueueFull)


def _openai_response(err: Exception) -> JSONResponse:
    error = as_openai_error(err)
    return JSONResponse(openai_error_body(error), status_code=error.status)


OpenAIRoute = answering_route("OpenAIRoute", _ANSWERED, _openai_response)
"""A route answering its own validation, input and runtime errors in OpenAI's shape."""


def openai_sse(deltas: AsyncIterator, events: AsyncIterator[BaseModel]) -> AsyncIterator[bytes]:
    """The events as server-sent events, errors in OpenAI's body."""
    return server_sent_events(
        events, deltas, lambda event: event.model_dump_json(),
        lambda err: openai_error_body(as_openai_error(err)),
    )
