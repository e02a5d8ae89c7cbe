"""The bodies of OpenAI's Responses API (``POST /v1/responses``), as pydantic models: the
request, its input items, and the response object with its output items.

Requests refuse unknown fields (a 400 naming the field). Besides the fields this server
uses, a request may carry what the ``openai`` client and the OpenAI Agents SDK send by
default or at neutral values: ``include`` (empty), ``store``, ``metadata``, ``truncation``,
``user``, ``reasoning`` (its ``effort`` and ``summary`` are taken; no summary is written),
``text.verbosity``. Input items that the server wrote itself and a client sends back (the
Agents SDK does: messages with ``id``/``status``, ``output_text`` parts with
``annotations``/``logprobs``, reasoning items) are accepted with those fields.

The response models hold what ``openai.types.responses.Response`` requires (``id``,
``created_at``, ``model``, ``object``, ``output``, ``parallel_tool_calls``,
``tool_choice``, ``tools``) and the request fields OpenAI echoes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

MAX_INPUT_ITEMS = 16_384
"""The most input items one request may have (as ``MAX_CHAT_MESSAGES`` for chat)."""


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


# Input items --------------------------------------------------------------------------------


class TextPart(_Request):
    """A text part of a message: ``input_text`` (what a user or system says) or
    ``output_text`` (an assistant's earlier answer, sent back)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(_Request):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallItem(_Request):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ReasoningInputItem(_Request):
    """A reasoning item sent back; it is not part of the next prompt."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_kind(item: Any) -> str:
    """An item's ``type``; a message may leave it out (OpenAI's "easy input message")."""
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "")
    return kind if isinstance(kind, str) else ""


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningInputItem, Tag("reasoning")],
    Discriminator(_item_kind),
]


# Request ------------------------------------------------------------------------------------


class FunctionToolParam(_Request):
    """A function the model may call (the only kind of tool served)."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedToolChoice(_Request):
    type: Literal["function"]
    name: str


ToolChoiceParam = Literal["auto", "none", "required"] | NamedToolChoice


class ReasoningParam(_Request):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class TextFormat(_Request):
    """``text.format``: plain text, any JSON object, or JSON valid against ``schema``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextParam(_Request):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(_Request):
    """The body of ``POST /v1/responses``."""

    model: str
    input: str | Annotated[list[InputItem], Field(max_length=MAX_INPUT_ITEMS)] = []
    instructions: str | None = None
    tools: list[FunctionToolParam] | None = None
    tool_choice: ToolChoiceParam = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningParam | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    text: TextParam | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    include: list[Literal["message.output_text.logprobs", "reasoning.encrypted_content"]] \
        | None = None


# Response -----------------------------------------------------------------------------------

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = []
    content: list[ReasoningText]
    status: ItemStatus


class FunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = ReasoningItem | OutputMessage | FunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int
    """Prompt tokens read from the radix cache."""


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(BaseModel):
    """Why a response failed: ``server_error`` (an aborted generation, a fault of the
    server's) or ``invalid_request_error`` (the request's fault, found after the stream
    began)."""

    code: Literal["server_error", "invalid_request_error"]
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """A response: its output items and usage, with the request's settings echoed."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    instructions: str | None = None
    tools: list[FunctionToolParam]
    tool_choice: ToolChoiceParam
    parallel_tool_calls: bool
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    previous_response_id: str | None = None
    reasoning: ReasoningParam | None = None
    metadata: dict[str, str] = {}
    text: TextParam | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    user: str | None = None
    store: bool = True
    background: bool = False


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True
