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
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from radixlm.runtime.engine.engine import Engine
from radixlm.runtime.engine.request_inputs import GenerateInput
from radixlm.runtime.engine.request_state import OutputDelta
from radixlm.runtime.grammar.constraints import CONSTRAINT_KINDS
from radixlm.runtime.server.model_names import resolve_model, unknown_model_message
from radixlm.runtime.server.openai_chat import (
    assistant_message,
    chat_finish_reason,
    chat_stream_events,
    prepare_openai_chat_turn,
)
from radixlm.runtime.server.openai_errors import (
    ERROR_RESPONSES,
    OpenAIError,
    OpenAIRoute,
    openai_sse,
)
from radixlm.runtime.server.openai_outputs import (
    ChoiceProgress,
    chat_logprobs,
    completion_logprobs,
    delta_logprobs,
    final_usage,
    finish_type,
    meta_finish_reason,
    meta_logprobs,
    outputs_usage,
)
from radixlm.runtime.server.openai_protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    SamplingExtras,
)
from radixlm.runtime.server.sglang_fields import CHAT_FIELDS, COMPLETION_FIELDS, check_neutral


def add_openai_routes(app: FastAPI, engine: Engine, served_model_name: str) -> None:
    """Adds the ``/v1`` routes serving ``engine`` under the name ``served_model_name``."""
    router = APIRouter(prefix="/v1", route_class=OpenAIRoute, tags=["openai"])
    started = int(time.time())


    def check_model(body: BaseModel) -> str | None:
        """The LoRA adapter ``body`` asks for (None: the base model): its ``model`` names
        the model, ``model:adapter``, or an adapter; SGLang's ``lora_path`` names one too."""
        # The model path is accepted too: it is what /get_model_info reports, and what
        # SGLang's router lists as the model (SGLang accepts it as well).
        known, adapter = resolve_model(engine, body.model, served_model_name)
        if not known:
            raise OpenAIError(404, unknown_model_message(engine, body.model, served_model_name),
                              param="model", code="model_not_found")
        return adapter or getattr(body, "lora_path", None)

    @router.get("/models", response_model=ModelList)
    async def models() -> ModelList:
        cards = [ModelCard(id=served_model_name, created=started)]
        cards += [ModelCard(id=name, created=started, parent=served_model_name)
                  for name in engine.lora_adapters()]
        return ModelList(data=cards)

    @router.post("/completions", response_model=CompletionResponse,
                 responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest):
        adapter = check_model(body)
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
            lora_path=adapter, **_bootstrap(body),
        )
        result = await (engine.stream_deltas(request) if body.stream
                        else engine.generate_request(request))
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": body.model}
        if texts is None:  # decoded once the Engine has checked the ids
            texts = [engine.tokenizer.decode(ids) if body.echo else "" for ids in id_lists]
        echoes = texts if body.echo else [""] * len(texts)
        if body.stream:
            events = _completion_events(result, head, echoes, body)
            return StreamingResponse(openai_sse(result, events), media_type="text/event-stream")
        choices = []
        for index, out in enumerate(result):
            echo = echoes[index // body.n]
            logprobs = None
            if want_logprobs:
                meta = out["meta_info"]
                logprobs = completion_logprobs(
                    *meta_logprobs(meta, "output"), 0,
                    prompt=meta_logprobs(meta, "input") if body.echo else None)
            choices.append(CompletionChoice(
                index=index, text=echo + out["text"], logprobs=logprobs,
                finish_reason=meta_finish_reason(out["meta_info"]),
            ))
        return CompletionResponse(**head, choices=choices,
                                  usage=outputs_usage(result, body.n))

    @router.post("/chat/completions", response_model=ChatCompletionResponse,
                 responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest):
        adapter = check_model(body)
        check_neutral(_given(body), CHAT_FIELDS)
        if body.top_logprobs and not body.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        turn = await prepare_openai_chat_turn(engine, body, _response_schema(body))
        params = _sampling_params(body, body.max_completion_tokens or body.max_tokens)
        extras = [kind for kind in CONSTRAINT_KINDS if kind in params]
        if extras and any(kind in turn.sampling_params for kind in CONSTRAINT_KINDS):
            raise OpenAIError(400, f"{extras[0]} cannot be combined with a tool grammar "
                              "(tool_choice required or a named function, a strict function, "
                              "or response_format with tools)", param=extras[0])
        # The turn's own (its grammar, special tokens kept for the reader) win.
        params = {**params, **turn.sampling_params}
        request = GenerateInput(
            input_ids=[turn.prompt_ids], sampling_params=params, return_logprob=body.logprobs,
            top_logprobs_num=body.top_logprobs if body.logprobs else None,
            return_text_in_logprobs=True, rid=body.rid, extra_key=body.extra_key,
            lora_path=adapter, **_bootstrap(body),
        )
        result = await (engine.stream_deltas(request) if body.stream
                        else engine.generate_request(request))
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": body.model}
        if body.stream:
            events = chat_stream_events(result, head, body, turn)
            return StreamingResponse(openai_sse(result, events), media_type="text/event-stream")
        choices = []
        for index, out in enumerate(result):
            read = turn.read(out["text"])
            choices.append(ChatChoice(
                index=index, message=assistant_message(read),
                logprobs=chat_logprobs(*meta_logprobs(out["meta_info"], "output"))
                if body.logprobs else None,
                finish_reason=chat_finish_reason(meta_finish_reason(out["meta_info"]),
                                                 bool(read.tool_calls)),
            ))
        return ChatCompletionResponse(**head, choices=choices,
                                  usage=outputs_usage(result, body.n))

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
    """``response_format`` as a constraint (``_response_schema``)."""
    schema = _response_schema(body)
    return {} if schema is None else {"json_schema": json.dumps(schema)}


def _response_schema(body: SamplingExtras) -> dict[str, Any] | None:
    """``response_format``'s schema: ``json_object`` is any JSON object, ``json_schema``
    its schema, ``text`` (or none) None. It cannot be combined with the regex / ebnf /
    json_schema extras (one constraint per request)."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    extras = [name for name in ("regex", "ebnf", "json_schema") if getattr(body, name)]
    if extras:
        raise OpenAIError(400, f"response_format cannot be combined with {extras[0]} (give "
                          "one constraint)", param="response_format")
    if fmt.type == "json_object":
        return {"type": "object"}
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise OpenAIError(400, "response_format json_schema needs json_schema.schema",
                          param="response_format")
    return fmt.json_schema.schema_


async def _completion_events(
    deltas: AsyncIterator[tuple[int, OutputDelta]], head: dict[str, Any], echoes: list[str],
    body: CompletionRequest,
) -> AsyncIterator[BaseModel]:
    progress: dict[int, ChoiceProgress] = {}
    async for index, delta in deltas:
        state = progress.setdefault(index, ChoiceProgress())
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
            logprobs = completion_logprobs(*delta_logprobs(delta), state.logprob_chars,
                                            prompt=prompt)
            state.logprob_chars += sum(len(token) for token in logprobs.tokens)
        choice = CompletionChoice(index=index, text=echo + delta.text, logprobs=logprobs,
                                  finish_reason=finish_type(delta.finish_reason))
        yield CompletionResponse(**head, choices=[choice])
    if body.stream_options is not None and body.stream_options.include_usage:
        yield CompletionResponse(**head, choices=[], usage=final_usage(progress, body.n))


