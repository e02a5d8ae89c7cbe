"""Anthropic's Messages API bodies (``POST /v1/messages``, ``/v1/messages/count_tokens``) as
pydantic models: requests, responses and the events of a streamed response.

Requests refuse unknown fields, as the OpenAI bodies do (``openai_protocol.py``);
``cache_control`` is taken where Anthropic allows it and ignored (the radix cache reuses
every shared prefix without being asked). A content block is one of the input block types
by its ``type``; the unions carry CamelCase tags (``TextBlock``, ``Blocks``), which never
collide with a field's snake_case name, so an error's field path can leave them out
(``anthropic_errors.field_path``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from radixlm.runtime.sampling.sampling_params import TOP_K_MAX
from radixlm.runtime.server.openai_protocol import MAX_CHAT_MESSAGES

# Requests ------------------------------------------------------------------------------------


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextBlock(_Request):
    """A text block of a message, a tool result or the system prompt."""

    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(_Request):
    """A call the assistant made, in the history."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(_Request):
    """The assistant's reasoning, in the history (left out of the prompt)."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(_Request):
    """Reasoning a provider returned encrypted, in the history (left out of the prompt)."""

    type: Literal["redacted_thinking"]
    data: str


class ToolResultBlock(_Request):
    """What a tool returned for the ``tool_use`` whose id is ``tool_use_id``."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: dict[str, Any] | None = None


BLOCK_TAGS = {"text": "TextBlock", "tool_use": "ToolUseBlock", "tool_result": "ToolResultBlock",
              "thinking": "ThinkingBlock", "redacted_thinking": "RedactedThinkingBlock"}
"""Each input block ``type`` and its union tag."""

UNKNOWN_BLOCK = "unknown_block_type"
"""The validation error type of a block whose ``type`` is none of ``BLOCK_TAGS``."""


def _block_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return BLOCK_TAGS.get(kind) if isinstance(kind, str) else None


InputBlock = Annotated[
    (Annotated[TextBlock, Tag("TextBlock")]
     | Annotated[ToolUseBlock, Tag("ToolUseBlock")]
     | Annotated[ToolResultBlock, Tag("ToolResultBlock")]
     | Annotated[ThinkingBlock, Tag("ThinkingBlock")]
     | Annotated[RedactedThinkingBlock, Tag("RedactedThinkingBlock")]),
    Discriminator(_block_tag, custom_error_type=UNKNOWN_BLOCK,
                  custom_error_message=f"unknown content block type; expected one of "
                                       f"{', '.join(BLOCK_TAGS)}"),
]


def _text_or_blocks(value: Any) -> str:
    return "String" if isinstance(value, str) else "Blocks"


Content = Annotated[
    Annotated[str, Tag("String")] | Annotated[list[InputBlock], Tag("Blocks")],
    Discriminator(_text_or_blocks),
]
SystemPrompt = Annotated[
    Annotated[str, Tag("String")] | Annotated[list[TextBlock], Tag("Blocks")],
    Discriminator(_text_or_blocks),
]


class InputMessage(_Request):
    """A message of the conversation: a string (one text block) or blocks."""

    role: Literal["user", "assistant"]
    content: Content


class Tool(_Request):
    """A function the model may call; ``input_schema`` is the JSON schema of its input, an
    object's (Anthropic's rule)."""

    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        if schema.get("type") != "object":
            raise ValueError(f"a JSON schema of type object is needed, got type "
                             f"{schema.get('type')!r}")
        return schema


class ToolChoice(_Request):
    """``auto`` (the model decides), ``any`` (at least one call), ``tool`` (a call of
    ``name``), ``none`` (no call)."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("name is given with type tool, and only then")
        return self


class ThinkingConfig(_Request):
    """``enabled`` with a budget of reasoning tokens, ``adaptive`` (thinking on, no budget),
    or ``disabled``. Thinking is always shown (``display`` ``omitted`` is not served)."""

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(default=None, ge=1)
    display: Literal["summarized"] | None = None

    @model_validator(mode="after")
    def _budget_when_enabled(self) -> ThinkingConfig:
        if (self.type == "enabled") != (self.budget_tokens is not None):
            raise ValueError("budget_tokens is given with type enabled, and only then")
        return self


class Metadata(_Request):
    """The caller's metadata (taken and ignored)."""

    user_id: str | None = None


class CountTokensRequest(_Request):
    """The prompt of a request: what ``/v1/messages/count_tokens`` counts."""

    model: str
    messages: list[InputMessage] = Field(min_length=1, max_length=MAX_CHAT_MESSAGES)
    system: SystemPrompt | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    cache_control: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    """A ``/v1/messages`` body: the prompt and how to sample its answer. A thinking
    budget is below ``max_tokens`` (Anthropic's rule)."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1, le=TOP_K_MAX)
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None

    @model_validator(mode="after")
    def _budget_below_max_tokens(self) -> MessagesRequest:
        budget = self.thinking.budget_tokens if self.thinking else None
        if budget is not None and budget >= self.max_tokens:
            raise ValueError(f"thinking.budget_tokens ({budget}) must be less than "
                             f"max_tokens ({self.max_tokens})")
        return self


# Responses -----------------------------------------------------------------------------------


class TextOut(BaseModel):
    """Text the model wrote."""

    type: Literal["text"] = "text"
    text: str


class ThinkingOut(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""
    """Empty: a local model's reasoning is not signed (clients send it back as it is)."""


class ToolUseOut(BaseModel):
    """A call the model made; ``input`` is its arguments."""

    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


OutputBlock = TextOut | ThinkingOut | ToolUseOut
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Usage(BaseModel):
    """Tokens of a request. ``input_tokens`` are the prompt's tokens not read from the
    cache; ``cache_read_input_tokens`` those that were (Anthropic's split: they add up to
    the prompt)."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class Message(BaseModel):
    """The answer: its blocks in the order the model wrote them, why it stopped, its
    usage."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[OutputBlock]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: Usage


class TokenCount(BaseModel):
    """The prompt's length in tokens: ``/v1/messages/count_tokens``'s answer."""

    input_tokens: int


class ErrorDetail(BaseModel):
    """An error's type (``invalid_request_error``, ...) and message."""

    type: str
    message: str


class ErrorResponse(BaseModel):
    """Anthropic's error body."""

    type: Literal["error"] = "error"
    error: ErrorDetail


# Stream events -------------------------------------------------------------------------------


class MessageStart(BaseModel):
    """A stream's first event: the message without content, its usage the prompt's."""

    type: Literal["message_start"] = "message_start"
    message: Message


class ContentBlockStart(BaseModel):
    """A block's start: the block, empty, at ``index``."""

    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: OutputBlock


class TextDelta(BaseModel):
    """Text to append to a text block."""

    type: Literal["text_delta"] = "text_delta"
    text: str


class ThinkingDelta(BaseModel):
    """Reasoning to append to a thinking block."""

    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class InputJsonDelta(BaseModel):
    """JSON text to append to a ``tool_use`` block's input (the deltas join to it)."""

    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ContentBlockDelta(BaseModel):
    """A delta of the block at ``index``, the block started last."""

    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | ThinkingDelta | InputJsonDelta


class ContentBlockStop(BaseModel):
    """The end of the block at ``index``."""

    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageEnd(BaseModel):
    """Why the message stopped, and the stop sequence that matched."""

    stop_reason: StopReason | None
    stop_sequence: str | None = None


class MessageDelta(BaseModel):
    """The message's end: why it stopped and its final usage (totals, not increments)."""

    type: Literal["message_delta"] = "message_delta"
    delta: MessageEnd
    usage: Usage


class MessageStop(BaseModel):
    """A stream's last event."""

    type: Literal["message_stop"] = "message_stop"


StreamEvent = (MessageStart | ContentBlockStart | ContentBlockDelta | ContentBlockStop
               | MessageDelta | MessageStop)
"""The events a stream sends, in ``anthropic_stream``'s order (an ``error`` event aside)."""
