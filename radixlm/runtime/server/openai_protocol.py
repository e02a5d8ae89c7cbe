"""The OpenAI API's request and response bodies (docs/compatibility.md, section 2), as pydantic
models, so that validation and ``/openapi.json`` both come from one description.

Requests refuse unknown fields. Besides OpenAI's own fields they take SGLang's extras (what
the ``openai`` client's ``extra_body`` sends): ``top_k``, ``min_p``, ``min_tokens``,
``regex``, ``ebnf``, ``json_schema``, ``stop_token_ids``, ``stop_regex``, ``ignore_eos``,
``no_stop_trim``, ``skip_special_tokens``, ``repetition_penalty``, ``rid``, ``extra_key``
and (chat) ``chat_template_kwargs``; vLLM's beam search extras ``use_beam_search``,
``length_penalty`` and ``early_stopping``; and the rest of SGLang's request fields at their
neutral values (``sglang_fields.py``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from radixlm.runtime.sampling.sampling_params import INT64_MAX, SEED_MAX, TOP_K_MAX
from radixlm.runtime.server.sglang_fields import CHAT_FIELDS, COMPLETION_FIELDS, fields_model

MAX_CHAT_MESSAGES = 16_384
"""The most messages one chat may have. Checked while the body is validated, so a list of
a million empty messages costs a fraction of a second, not the validation of each (the
characters of all of them together are then bounded by the context: ``chat_chars``)."""

class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingExtras(_Request):
    """Fields shared by both generation routes, named as OpenAI (and SGLang) name them."""

    model: str
    n: int = Field(default=1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=SEED_MAX)
    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # SGLang's extras.
    top_k: int | None = Field(default=None, ge=-1, le=TOP_K_MAX)
    min_p: float | None = None
    min_tokens: int | None = Field(default=None, ge=0, le=INT64_MAX)
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    ignore_eos: bool | None = None
    no_stop_trim: bool | None = None
    skip_special_tokens: bool | None = None
    repetition_penalty: float | None = None
    response_format: ResponseFormat | None = None
    rid: str | list[str] | None = None
    extra_key: str | None = None
    # vLLM's beam search extras: ``n`` beams, the n best outputs as the choices.
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    early_stopping: bool | Literal["never"] | None = None
    # Set by SGLang's router for prefill/decode disaggregation (``GenerateInput``'s).
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | None | list[int | None] = None
    bootstrap_room: int | list[int] | None = None


class CompletionRequest(fields_model("_CompletionFields", COMPLETION_FIELDS, SamplingExtras)):
    """The body of ``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str


class MessageToolCall(BaseModel):
    """A call an assistant message of the history made."""

    model_config = ConfigDict(extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message of a chat; only text content is supported."""

    model_config = ConfigDict(extra="ignore")  # refusal, audio, ... are not used

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    reasoning_content: str | None = None  # an earlier turn's: not part of the prompt


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(fields_model("_ChatFields", CHAT_FIELDS, SamplingExtras)):
    """The body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_CHAT_MESSAGES)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None (or absent): true, as OpenAI's default
    # SGLang's reasoning switches: split the thinking off (``reasoning_content``), and
    # stream it (else it comes in the last chunk); a thinking budget.
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    max_reasoning_tokens: int | None = Field(default=None, ge=0, le=INT64_MAX)


# Responses ------------------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "radixlm"
    parent: str | None = None
    """The base model of a LoRA adapter (as vLLM lists adapters); None for the model."""


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """A completion, or (with ``stream``) one chunk of one, whose text is a delta."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class _WithoutNones(BaseModel):
    """Serialised without its None fields: a client's stream accumulator merges a chunk's
    fields into what it has, so a null ``type`` or ``name`` would overwrite the first
    piece's value."""

    @model_serializer(mode="wrap")
    def _without_nones(self, handler):
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaFunction(_WithoutNones):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_WithoutNones):
    """A piece of a streamed call: its first piece has the id, type and name (arguments
    empty), the next ones pieces of the arguments (``index`` says which call)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
