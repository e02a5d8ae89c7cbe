"""``OpenAI``: any OpenAI-compatible endpoint (OpenAI itself, radixlm's ``/v1``, vLLM, SGLang).

Chat models (the default) see the program's finished role turns as messages, so a ``gen``
must open a fresh assistant turn: the Chat API cannot continue a half-written one. Completion
models see the text rendered with a built-in template. ``select`` needs the logprobs of the
prompt's own tokens, which only the Completions API returns (``echo`` with ``logprobs``);
on a chat model it fails with a message that says so.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from radixlm.frontend_lang.backends.base import Backend, BackendError, Prompt
from radixlm.frontend_lang.chat_template import ChatTemplate, template_for_model_name
from radixlm.frontend_lang.choices import ChoiceScores, ChoicesDecision, ChoicesMethod
from radixlm.frontend_lang.ir import GenParams


class OpenAI(Backend):
    """The model ``model_name`` at ``base_url`` (OpenAI's own API when ``None``)."""

    def __init__(self, model_name: str, base_url: str | None = None,
                 api_key: str | None = None, is_chat_model: bool = True,
                 chat_template: ChatTemplate | None = None, timeout: float = 600.0) -> None:
        try:
            import openai
        except ImportError:
            raise ImportError("the OpenAI backend needs the openai package: "
                              "pip install openai") from None
        self.model_name = model_name
        self.is_chat_model = is_chat_model
        self._template = chat_template or template_for_model_name(model_name)
        self._openai = openai
        self.client = openai.OpenAI(base_url=base_url, timeout=timeout, max_retries=0,
                                    api_key=api_key or os.environ.get("OPENAI_API_KEY", "EMPTY"))

    @property
    def chat_template(self) -> ChatTemplate:
        return self._template

    def generate(self, prompt: Prompt, params: GenParams) -> tuple[str, dict[str, Any]]:
        response = self._create(prompt, params, stream=False)
        choice = response.choices[0]
        text = choice.message.content if self.is_chat_model else choice.text
        return text or "", _meta(response.id, choice.finish_reason, response.usage)

    def generate_stream(self, prompt: Prompt,
                        params: GenParams) -> Iterator[tuple[str, dict[str, Any]]]:
        meta: dict[str, Any] = {}
        for chunk in self._create(prompt, params, stream=True):
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            piece = (choice.delta.content if self.is_chat_model else choice.text) or ""
            meta = _meta(chunk.id, choice.finish_reason, getattr(chunk, "usage", None))
            yield piece, meta

    def select(self, prompt: Prompt, choices: list[str], method: ChoicesMethod,
               temperature: float) -> ChoicesDecision:
        if self.is_chat_model:
            raise BackendError(
                "select needs the logprobs of given text, which OpenAI chat models do not "
                "return; use a completion model (OpenAI(..., is_chat_model=False)) whose "
                "endpoint supports echo with logprobs, or the native RuntimeEndpoint")
        if method.needs_unconditional:
            raise BackendError("unconditional_likelihood_normalized is not available on "
                               "OpenAI endpoints; use the native RuntimeEndpoint")
        response = self._call(self.client.completions.create, model=self.model_name,
                              prompt=[prompt.text + c for c in choices], max_tokens=0,
                              echo=True, logprobs=0, temperature=0)
        scored = []
        for choice in sorted(response.choices, key=lambda c: c.index):
            logprobs = choice.logprobs
            if logprobs is None or not logprobs.token_logprobs:
                raise BackendError("select: the endpoint returned no prompt logprobs")
            # The tokens that end past the prompt's text belong to the choice.
            scored.append([
                lp for lp, offset, token in zip(logprobs.token_logprobs, logprobs.text_offset,
                                                 logprobs.tokens)
                if offset + len(token) > len(prompt.text) and lp is not None])
        return method(ChoiceScores(choices, scored))

    def _create(self, prompt: Prompt, params: GenParams, stream: bool) -> Any:
        if params.n not in (None, 1):
            raise ValueError("gen(n=...) above 1 is not supported; use s.fork(n)")
        options, extra = _openai_options(params)
        if not self.is_chat_model:
            return self._call(self.client.completions.create, model=self.model_name,
                              prompt=prompt.text, stream=stream, extra_body=extra, **options)
        if prompt.open_role != "assistant" or prompt.open_content:
            raise BackendError(
                "on an OpenAI chat model a gen must open an assistant turn: write "
                "s += assistant(gen(...)) after the user turn, with no text before the gen")
        return self._call(self.client.chat.completions.create, model=self.model_name,
                          messages=prompt.messages, stream=stream, extra_body=extra, **options)

    def _call(self, create: Any, **kwargs: Any) -> Any:
        try:
            return create(**kwargs)
        except self._openai.APIStatusError as err:
            raise BackendError(f"the OpenAI endpoint refused the request (HTTP "
                               f"{err.status_code}): {err.message}") from None
        except self._openai.APIConnectionError as err:
            raise BackendError(f"cannot reach the OpenAI endpoint at {self.client.base_url}: "
                               f"{err}") from None


def _openai_options(params: GenParams) -> tuple[dict[str, Any], dict[str, Any]]:
    """The standard arguments and the ``extra_body`` of a request for ``params``."""
    standard = {"max_tokens": params.max_new_tokens, "stop": params.stop,
                "temperature": params.temperature, "top_p": params.top_p,
                "frequency_penalty": params.frequency_penalty,
                "presence_penalty": params.presence_penalty}
    options = {k: v for k, v in standard.items() if v is not None}
    extras = {"top_k": params.top_k, "min_p": params.min_p, "ignore_eos": params.ignore_eos,
              "min_tokens": params.min_new_tokens, "stop_token_ids": params.stop_token_ids,
              "regex": params.effective_regex}
    extra = {k: v for k, v in extras.items() if v not in (None, -1)}
    if params.json_schema:
        schema = json.loads(params.json_schema) if isinstance(params.json_schema, str) \
            else params.json_schema
        options["response_format"] = {"type": "json_schema",
                                      "json_schema": {"name": "output", "schema": schema}}
    return options, extra


def _meta(rid: str, finish_reason: str | None, usage: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"id": rid, "finish_reason": finish_reason and {"type": finish_reason}}
    if usage is not None:
        meta["prompt_tokens"] = usage.prompt_tokens
        meta["completion_tokens"] = usage.completion_tokens
    return meta
