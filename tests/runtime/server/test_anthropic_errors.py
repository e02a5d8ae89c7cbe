"""Anthropic's error body (``anthropic_errors.py``): each error's status and type, and a
message that starts with the field at fault as a dotted path, also where the chat turn
(which writes OpenAI's ``tools[1]``) refused the input. The routes' answers are checked on
a live server in ``test_anthropic_api.py``."""

from __future__ import annotations

import pytest

from radixlm.runtime.engine.errors import QueueFull, RuntimeUnavailable
from radixlm.runtime.server.anthropic_errors import (
    AnthropicError,
    as_anthropic_error,
    field_path,
)
from radixlm.runtime.server.chat_turn import ChatTurnError


@pytest.mark.parametrize("message, param, expected", [
    ("this model's tokenizer has no chat template; start the server with --chat-template",
     "messages", "messages: this model's tokenizer has no chat template;"),
    ("tools[1]: the function name 'f' is given twice", "tools[1].name",
     "tools.1.name: the function name 'f' is given twice"),
    ("tools[0] (f): parameters must be a JSON schema of type object, got [1]",
     "tools[0].parameters", "tools.0.parameters: parameters must be a JSON schema of type "
                            "object, got [1]"),
    ("tool_choice: this parser cannot force a call", "tool_choice",
     "tool_choice: this parser cannot force a call"),
    ("tool_choice 'required' needs tools", "tool_choice",
     "tool_choice: tool_choice 'required' needs tools"),
])
def test_a_chat_turn_error_starts_with_its_field_dotted(message, param, expected):
    error = as_anthropic_error(ChatTurnError(message, param=param))
    assert error.status == 400 and error.kind == "invalid_request_error"
    assert error.message.startswith(expected), error.message


@pytest.mark.parametrize("err, status, kind", [
    (QueueFull("the queue is full"), 503, "overloaded_error"),
    (RuntimeUnavailable("the runtime is down"), 503, "api_error"),
    (ValueError("prompt too long"), 400, "invalid_request_error"),
    (AnthropicError(404, "model: `x` does not exist"), 404, "not_found_error"),
    (AnthropicError(500, "the generation was aborted"), 500, "api_error"),
])
def test_each_error_has_anthropics_status_and_type(err, status, kind):
    error = as_anthropic_error(err)
    assert (error.status, error.kind) == (status, kind)
    assert error.body() == {"type": "error", "error": {"type": kind, "message": str(err)}}


def test_a_field_path_leaves_out_the_body_and_the_union_tags():
    assert field_path(("body", "messages", 0, "content", "Blocks", 1, "TextBlock", "text")) == (
        "messages.0.content.1.text")
    assert field_path(("body",)) == "body"
