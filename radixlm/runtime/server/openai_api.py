"""The OpenAI API over an Engine (docs/compatibility.md, section 2): ``/v1/models``,
``/v1/completions`` and ``/v1/chat/completions``, streamed or not.

Errors use OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``: 400 for bad
input (a body that is not JSON, fails validation, or that the Engine refuses), 404 for a
model other than the served one, 503 when the queue is full or the runtime is down. The
routes catch their own errors (``OpenAIRoute``), so the app's native-API handlers never see
them; the app's middleware (API key, body size) still runs first.

Choices are prompt-major: sample ``j`` of prompt ``i`` is choice ``i * n + j``. A native
finish reason of type ``stop`` or ``length`` keeps its name; an aborted request ends with
``"abort"`` (OpenAI has no such value; clients treat it as an unknown reason rather than a
normal end). Completion ``text_offset``s add up the texts of the tokens before (the
prompt's first, with ``echo``), so a token cut inside a UTF-8 character counts as the one
replacement character its text shows.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel

from radixlm.runtime.engine.engine import Engine
from radixlm.runtime.engine.errors import QueueFull, RuntimeUnavailable
from radixlm.runtime.engine.request_inputs import GenerateInput
from radixlm.runtime.engine.request_state import OutputDelta
from radixlm.runtime.server.openai_protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Delta,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    SamplingExtras,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from radixlm.runtime.server.server_sent_events import StreamFailed, server_sent_events
from radixlm.runtime.server.sglang_fields import CHAT_FIELDS, COMPLETION_FIELDS, check_neutral

_ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 500: "server_error",
                503: "server_error"}
_ERRORS = {status: {"model": ErrorResponse} for status in _ERROR_TYPES}


class OpenAIError(Exception):
    """An error to answer with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def openai_error_body(err: OpenAIError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": _ERROR_TYPES.get(err.status, "error"),
                      "param": err.param, "code": err.code}}


def _as_openai_error(err: Exception) -> OpenAIError:
    if isinstance(err, OpenAIError):
        return err
    if isinstance(err, RequestValidationError):
        first = err.errors()[0]
        field = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return OpenAIError(400, f"{field or 'body'}: {first.get('msg', 'invalid value')}",
                           param=field)
    if isinstance(err, QueueFull):
        return OpenAIError(503, str(err), code="queue_full")
    if isinstance(err, RuntimeUnavailable):
        return OpenAIError(503, str(err))
    if isinstance(err, StreamFailed):
        return OpenAIError(500, str(err))
    return OpenAIError(400, str(err))


_ANSWERED = (OpenAIError, RequestValidationError, ValueError, RuntimeUnavailable, QueueFull)


class OpenAIRoute(APIRoute):
    """A route answering its own validation, input and runtime errors in OpenAI's shape."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except _ANSWERED as err:
                error = _as_openai_error(err)
                return JSONResponse(openai_error_body(error), status_code=error.status)

        return guarded


def add_openai_routes(app: FastAPI, engine: Engine, served_model_name: str) -> None:
    """Adds the ``/v1`` routes serving ``engine`` under the name ``served_model_name``."""
    router = APIRouter(prefix="/v1", route_class=OpenAIRoute, tags=["openai"])
    started = int(time.time())

    def check_model(name: str) -> None:
        if name != served_model_name:
            raise OpenAIError(404, f"The model `{name}` does not exist; this server serves "
                              f"`{served_model_name}`", param="model", code="model_not_found")

    @router.get("/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=served_model_name, created=started)])

    @router.post("/completions", response_model=CompletionResponse, responses=_ERRORS)
    async def completions(body: CompletionRequest):
        check_model(body.model)
        check_neutral(_given(body), COMPLETION_FIELDS)
        prompt = body.prompt
        if not prompt:
            raise OpenAIError(400, "prompt is empty", param="prompt")
        if isinstance(prompt, str) or isinstance(prompt[0], str):
            texts = [prompt] if isinstance(prompt, str) else list(prompt)
            id_lists = None
        else:
            id_lists = [prompt] if isinstance(prompt[0], int) else list(prompt)
            texts = None
        want_logprobs = body.logprobs is not None
        params = _sampling_params(body, body.max_tokens)
        params.update(_response_format_params(body))
        request = GenerateInput(
            text=texts, input_ids=id_lists, sampling_params=params,
            return_logprob=want_logprobs, top_logprobs_num=body.logprobs,
            logprob_start_len=0 if want_logprobs and body.echo else None,
            return_text_in_logprobs=True, rid=body.rid, extra_key=body.extra_key,
            **_bootstrap(body),
        )
        result = await (engine.stream_deltas(request) if body.stream
                        else engine.generate_request(request))
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": served_model_name}
        if texts is None:  # decoded once the Engine has checked the ids
            texts = [engine.tokenizer.decode(ids) if body.echo else "" for ids in id_lists]
        echoes = texts if body.echo else [""] * len(texts)
        if body.stream:
            events = _completion_events(result, head, echoes, body)
            return StreamingResponse(_sse(result, events), media_type="text/event-stream")
        choices = []
        for index, out in enumerate(result):
            echo = echoes[index // body.n]
            logprobs = None
            if want_logprobs:
                meta = out["meta_info"]
                logprobs = _completion_logprobs(
                    *_meta_logprobs(meta, "output"), 0,
                    prompt=_meta_logprobs(meta, "input") if body.echo else None)
            choices.append(CompletionChoice(
                index=index, text=echo + out["text"], logprobs=logprobs,
                finish_reason=_finish_reason(out["meta_info"]),
            ))
        return CompletionResponse(**head, choices=choices, usage=_usage(result, body.n))

    @router.post("/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest):
        check_model(body.model)
        check_neutral(_given(body), CHAT_FIELDS)
        if body.tools and body.tool_choice != "none":
            raise OpenAIError(400, "tools are not supported yet", param="tools")
        if body.top_logprobs and not body.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if not getattr(engine.tokenizer, "chat_template", None):
            raise OpenAIError(400, "this model's tokenizer has no chat template; use "
                              "/v1/completions", param="messages")
        try:
            ids = await engine.async_chat_prompt_ids(
                [_template_message(m) for m in body.messages], body.chat_template_kwargs)
        except ValueError as err:  # the template refused them, or they are far too long
            raise OpenAIError(400, str(err), param="messages") from None
        params = _sampling_params(body, body.max_completion_tokens or body.max_tokens)
        params.update(_response_format_params(body))
        request = GenerateInput(
            input_ids=[ids], sampling_params=params, return_logprob=body.logprobs,
            top_logprobs_num=body.top_logprobs if body.logprobs else None,
            return_text_in_logprobs=True, rid=body.rid, extra_key=body.extra_key,
            **_bootstrap(body),
        )
        result = await (engine.stream_deltas(request) if body.stream
                        else engine.generate_request(request))
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": served_model_name}
        if body.stream:
            events = _chat_events(result, head, body)
            return StreamingResponse(_sse(result, events), media_type="text/event-stream")
        choices = [
            ChatChoice(
                index=index, message=AssistantMessage(content=out["text"]),
                logprobs=_chat_logprobs(*_meta_logprobs(out["meta_info"], "output"))
                if body.logprobs else None,
                finish_reason=_finish_reason(out["meta_info"]),
            )
            for index, out in enumerate(result)
        ]
        return ChatCompletionResponse(**head, choices=choices, usage=_usage(result, body.n))

    app.include_router(router)


# Requests -> the Engine's arguments ---------------------------------------------------------

_SAMPLING_NAMES = {
    "n": "n", "stop": "stop", "seed": "sampling_seed", "temperature": "temperature",
    "top_p": "top_p", "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty", "logit_bias": "logit_bias", "top_k": "top_k",
    "min_p": "min_p", "min_tokens": "min_new_tokens", "regex": "regex", "ebnf": "ebnf",
    "json_schema": "json_schema", "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos", "repetition_penalty": "repetition_penalty",
    "stop_regex": "stop_regex", "no_stop_trim": "no_stop_trim",
    "skip_special_tokens": "skip_special_tokens", "use_beam_search": "use_beam_search",
    "length_penalty": "length_penalty", "early_stopping": "early_stopping",
}


def _given(body: BaseModel) -> dict[str, Any]:
    """The fields ``body`` was sent with."""
    return {name: getattr(body, name) for name in body.model_fields_set}


def _bootstrap(body: SamplingExtras) -> dict:
    """The fields pairing a disaggregated request's halves (``GenerateInput``'s)."""
    return {name: getattr(body, name)
            for name in ("bootstrap_host", "bootstrap_port", "bootstrap_room")}


def _sampling_params(body: SamplingExtras, max_tokens: int | None) -> dict[str, Any]:
    """The native sampling parameters; what the body leaves out keeps the Engine's default
    (the model's generation config, then SGLang's)."""
    params = {native: getattr(body, name) for name, native in _SAMPLING_NAMES.items()}
    params["max_new_tokens"] = max_tokens
    return {key: value for key, value in params.items() if value is not None}


def _response_format_params(body: SamplingExtras) -> dict[str, Any]:
    """``response_format`` as a constraint: ``json_object`` is any JSON object,
    ``json_schema`` its schema. It cannot be combined with the regex / ebnf / json_schema
    extras (one constraint per request)."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return {}
    extras = [name for name in ("regex", "ebnf", "json_schema") if getattr(body, name)]
    if extras:
        raise OpenAIError(400, f"response_format cannot be combined with {extras[0]} (give "
                          "one constraint)", param="response_format")
    if fmt.type == "json_object":
        return {"json_schema": json.dumps({"type": "object"})}
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise OpenAIError(400, "response_format json_schema needs json_schema.schema",
                          param="response_format")
    return {"json_schema": json.dumps(fmt.json_schema.schema_)}


def _template_message(message: ChatMessage) -> dict[str, Any]:
    content = message.content
    if isinstance(content, list):
        content = "\n".join(part.text for part in content)
    rendered: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.name is not None:
        rendered["name"] = message.name
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


# Engine outputs -> responses ----------------------------------------------------------------


def _finish_reason(meta: dict[str, Any]) -> str | None:
    return _finish_type(meta.get("finish_reason"))


def _finish_type(reason: dict[str, Any] | None) -> str | None:
    return None if reason is None else reason["type"]


def _usage(outputs: list[dict[str, Any]], n: int) -> Usage:
    """Usage of whole outputs (native shape), ``n`` samples per prompt."""
    return _usage_of([(out["meta_info"]["prompt_tokens"], out["meta_info"]["completion_tokens"],
                       out["meta_info"]["cached_tokens"]) for out in outputs], n)


def _usage_of(counts: list[tuple[int, int, int]], n: int) -> Usage:
    """Usage from each choice's (prompt, completion, cached) tokens. Prompt tokens count
    once per prompt (its ``n`` samples share one prefill)."""
    firsts = counts[::n]
    prompt = sum(prompt_tokens for prompt_tokens, _, _ in firsts)
    completion = sum(completion_tokens for _, completion_tokens, _ in counts)
    cached = sum(cached_tokens for _, _, cached_tokens in firsts)
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


Logprobs = tuple[list[list[Any]], list[list[list[Any]] | None]]
"""Entries ``[logprob, token_id, text]`` and, per entry, its top alternatives (or None)."""


def _meta_logprobs(meta: dict[str, Any], part: str) -> Logprobs:
    """The ``input`` or ``output`` logprobs of a native ``meta_info``."""
    entries = meta[f"{part}_token_logprobs"]
    return entries, meta.get(f"{part}_top_logprobs") or [None] * len(entries)


def _delta_logprobs(delta: OutputDelta) -> Logprobs:
    """The output logprobs a delta brings."""
    entries = delta.output_token_logprobs
    return entries, delta.output_top_logprobs or [None] * len(entries)


def _completion_logprobs(entries: list, tops: list, offset: int,
                         prompt: Logprobs | None = None) -> CompletionLogprobs:
    """Completion logprobs of ``entries`` (after the ``prompt``'s, for ``echo``), their
    ``text_offset``s counting from ``offset``."""
    if prompt is not None:
        entries, tops = prompt[0] + entries, prompt[1] + tops
    result = CompletionLogprobs()
    for (logprob, _, text), top in zip(entries, tops):
        result.tokens.append(text)
        result.token_logprobs.append(logprob)
        # Distinct tokens may share a text (partial UTF-8 decodes to U+FFFD): keep the best.
        result.top_logprobs.append(None if top is None else {t: lp for lp, _, t in top[::-1]})
        result.text_offset.append(offset)
        offset += len(text)
    return result


def _chat_logprobs(entries: list, tops: list) -> ChatLogprobs:
    return ChatLogprobs(content=[
        TokenLogprob(token=text, logprob=logprob, bytes=list(text.encode()), top_logprobs=[
            TopLogprob(token=t, logprob=lp, bytes=list(t.encode())) for lp, _, t in top or []
        ])
        for (logprob, _, text), top in zip(entries, tops)
    ])


# Streaming ----------------------------------------------------------------------------------


class _ChoiceProgress:
    """What one choice's stream has sent, and the counts its usage needs."""

    def __init__(self) -> None:
        self.started = False
        self.logprob_chars = 0  # the next ``text_offset``: the texts of the tokens sent
        self.counts = (0, 0, 0)  # prompt, completion and cached tokens

    def advance(self, delta: OutputDelta) -> None:
        self.counts = (delta.prompt_tokens, self.counts[1] + len(delta.new_ids),
                       delta.cached_tokens)


def _final_usage(progress: dict[int, _ChoiceProgress], n: int) -> Usage:
    return _usage_of([progress[i].counts for i in sorted(progress)], n)


async def _completion_events(
    deltas: AsyncIterator[tuple[int, OutputDelta]], head: dict[str, Any], echoes: list[str],
    body: CompletionRequest,
) -> AsyncIterator[BaseModel]:
    progress: dict[int, _ChoiceProgress] = {}
    async for index, delta in deltas:
        state = progress.setdefault(index, _ChoiceProgress())
        echo = "" if state.started else echoes[index // body.n]
        with_prompt = body.echo and not state.started
        state.started = True
        state.advance(delta)
        logprobs = None
        if body.logprobs is not None:
            prompt = None
            if with_prompt:
                entries = delta.input_token_logprobs
                prompt = (entries, delta.input_top_logprobs or [None] * len(entries))
            logprobs = _completion_logprobs(*_delta_logprobs(delta), state.logprob_chars,
                                            prompt=prompt)
            state.logprob_chars += sum(len(token) for token in logprobs.tokens)
        choice = CompletionChoice(index=index, text=echo + delta.text, logprobs=logprobs,
                                  finish_reason=_finish_type(delta.finish_reason))
        yield CompletionResponse(**head, choices=[choice])
    if body.stream_options is not None and body.stream_options.include_usage:
        yield CompletionResponse(**head, choices=[], usage=_final_usage(progress, body.n))


async def _chat_events(deltas: AsyncIterator[tuple[int, OutputDelta]], head: dict[str, Any],
                       body: ChatCompletionRequest) -> AsyncIterator[BaseModel]:
    progress: dict[int, _ChoiceProgress] = {}
    async for index, delta in deltas:
        state = progress.setdefault(index, _ChoiceProgress())
        if not state.started:
            state.started = True
            opening = ChatChunkChoice(index=index, delta=Delta(role="assistant", content=""))
            yield ChatCompletionChunk(**head, choices=[opening])
        state.advance(delta)
        finish = _finish_type(delta.finish_reason)
        if not delta.text and finish is None:
            continue
        choice = ChatChunkChoice(
            index=index, delta=Delta(content=delta.text or None), finish_reason=finish,
            logprobs=_chat_logprobs(*_delta_logprobs(delta)) if body.logprobs else None,
        )
        yield ChatCompletionChunk(**head, choices=[choice])
    if body.stream_options is not None and body.stream_options.include_usage:
        yield ChatCompletionChunk(**head, choices=[], usage=_final_usage(progress, body.n))


def _sse(deltas: AsyncIterator, events: AsyncIterator[BaseModel]) -> AsyncIterator[bytes]:
    """The events as server-sent events, errors in OpenAI's body."""
    return server_sent_events(
        events, deltas, lambda event: event.model_dump_json(),
        lambda err: openai_error_body(_as_openai_error(err)),
    )
