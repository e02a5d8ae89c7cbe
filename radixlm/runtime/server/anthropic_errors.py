"""Anthropic's error body and the route class answering errors with it, for the Messages API
(``anthropic_api.py``; the stream's ``error`` event in ``anthropic_stream.py``):
``{"type": "error", "error": {"type", "message"}}``.

Invariant: every message starts with the field at fault as a dotted path
(``messages.0.content.1.type: ...``, ``tools.1.name: ...``), ``body`` where the whole body
is (not JSON). Statuses and types: 400 ``invalid_request_error`` for bad input (a body that
fails validation, or that the chat turn or the Engine refuses), 404 ``not_found_error`` for
a model other than the served one, 503 ``overloaded_error`` when the queue is full and
``api_error`` when the runtime is down, 500 ``api_error`` for an aborted generation or a
fault of the server's own.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from radixlm.runtime.engine.errors import QueueFull, RuntimeUnavailable
from radixlm.runtime.server.answering_route import answering_route
from radixlm.runtime.server.anthropic_protocol import UNKNOWN_BLOCK, ErrorResponse
from radixlm.runtime.server.chat_turn import ChatTurnError
from radixlm.runtime.server.server_sent_events import StreamFailed

_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 500: "api_error",
                503: "overloaded_error"}
ERROR_RESPONSES = {status: {"model": ErrorResponse} for status in _ERROR_TYPES}
"""The error bodies a route may answer, for its OpenAPI description."""


class AnthropicError(Exception):
    """An error to answer with Anthropic's error body; ``kind`` defaults to the status's
    type."""

    def __init__(self, status: int, message: str, kind: str | None = None):
        super().__init__(message)
        self.status, self.message = status, message
        self.kind = kind or _ERROR_TYPES.get(status, "api_error")

    def body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": self.kind, "message": self.message}}


def field_path(loc: tuple) -> str:
    """A validation error's location as a field path (``messages.0.content.1``): the union
    tags, CamelCase by ``anthropic_protocol``'s rule, left out."""
    parts = [str(part) for part in loc
             if part != "body" and not (isinstance(part, str) and part[:1].isupper())]
    return ".".join(parts) or "body"


def _dotted(path: str) -> str:
    return re.sub(r"\[(\d+)\]", r".\1", path)


def chat_turn_message(err: ChatTurnError) -> str:
    """A chat turn's error message led by its field in Anthropic's dotted form: the turn
    writes OpenAI's ``tools[1]: ...``, Anthropic ``tools.1.name: ...``."""
    path, message = _dotted(err.param), str(err)
    own = re.match(r"([\w.\[\]]+)(?: \([^)]*\))?: ", message)  # "tools[0] (f): "
    if own and path.startswith(_dotted(own.group(1))):
        message = message[own.end():]
    return f"{path}: {message}"


def as_anthropic_error(err: Exception) -> AnthropicError:
    """The Anthropic error answering ``err`` (the statuses in the module docstring)."""
    if isinstance(err, AnthropicError):
        return err
    if isinstance(err, RequestValidationError):
        first = err.errors()[0]
        path, message = field_path(first.get("loc", ())), first.get("msg", "invalid value")
        if first.get("type") == "json_invalid":  # its location is a character offset
            path = "body"
        if first.get("type") == UNKNOWN_BLOCK:
            given = first.get("input")
            kind = given.get("type") if isinstance(given, dict) else None
            path, message = f"{path}.type", f"{message} (got {kind!r})"
        return AnthropicError(400, f"{path}: {message.removeprefix('Value error, ')}")
    if isinstance(err, ChatTurnError):
        return AnthropicError(400, chat_turn_message(err))
    if isinstance(err, QueueFull):
        return AnthropicError(503, str(err))
    if isinstance(err, RuntimeUnavailable):
        return AnthropicError(503, str(err), kind="api_error")
    if isinstance(err, StreamFailed):  # a fault of the server's own, mid-stream
        return AnthropicError(500, str(err))
    return AnthropicError(400, str(err))


ANSWERED = (AnthropicError, RequestValidationError, ValueError, RuntimeUnavailable, QueueFull)
"""The errors answered in Anthropic's shape; any other is a fault of the server's own."""


def _anthropic_response(err: Exception) -> JSONResponse:
    error = as_anthropic_error(err)
    return JSONResponse(error.body(), status_code=error.status)


AnthropicRoute = answering_route("AnthropicRoute", ANSWERED, _anthropic_response)
"""A route answering its own validation, input and runtime errors in Anthropic's shape."""
