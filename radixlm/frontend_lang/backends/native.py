"""Backends that speak the native ``/generate`` protocol: the in-process Engine and, in
``runtime_endpoint.py``, a server over HTTP (radixlm's or SGLang's).

Both send the same request dicts; a subclass only moves them (``_post``, ``_post_stream``).

``select`` scores all choices in one batched request: it first caches the prompt (``max_new_
tokens: 0``, which also reports its token count P), then asks for the logprobs of
``prompt + choice`` from token P-1 on. Token P-1 is dropped when it is still the prompt's own
last token (same id); when the choice merged into it (the prompt's trailing space and the
choice's first word, say) it is kept, as part of the choice.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator
from typing import Any

from radixlm.frontend_lang.backends.base import Backend, BackendError, Prompt
from radixlm.frontend_lang.chat_template import ChatTemplate, from_renderer
from radixlm.frontend_lang.choices import ChoiceScores, ChoicesDecision, ChoicesMethod
from radixlm.frontend_lang.ir import GenParams


class NativeBackend(Backend):
    """Generation, streaming, select and prefix caching over native request dicts."""

    @abstractmethod
    def _post(self, payload: dict[str, Any]) -> Any:
        """Runs one native request; a dict back for one text, a list for a list."""

    @abstractmethod
    def _post_stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Runs one streamed native request; chunks whose ``text`` is cumulative."""

    def generate(self, prompt: Prompt, params: GenParams) -> tuple[str, dict[str, Any]]:
        out = self._post(_gen_payload(prompt.text, params))
        return out["text"], out["meta_info"]

    def generate_stream(self, prompt: Prompt,
                        params: GenParams) -> Iterator[tuple[str, dict[str, Any]]]:
        seen = ""
        for chunk in self._post_stream({**_gen_payload(prompt.text, params), "stream": True}):
            text = chunk["text"]
            yield text[len(seen):], chunk["meta_info"]
            seen = text

    def cache_prefix(self, text: str) -> None:
        if text:
            self._post({"text": text, "sampling_params": {"max_new_tokens": 0}})

    def select(self, prompt: Prompt, choices: list[str], method: ChoicesMethod,
               temperature: float) -> ChoicesDecision:
        text = prompt.text
        prompt_tokens = 0
        if text:
            cached = self._post({"text": text, "sampling_params": {"max_new_tokens": 0}})
            prompt_tokens = cached["meta_info"]["prompt_tokens"]
        # Logprobs from token P-1 on (a start of s > 0 reports tokens s+1 onwards; 0 reports
        # all). The prompt itself rides along to tell us its own last token.
        start = max(prompt_tokens - 2, 0)
        outs = self._post({
            "text": [text + choice for choice in choices] + [text],
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True, "logprob_start_len": start,
        })
        entries_of_prompt = outs.pop()["meta_info"]["input_token_logprobs"]
        last_prompt_token = entries_of_prompt[-1][1] if text and entries_of_prompt else None
        token_logprobs, token_ids = [], []
        for choice, out in zip(choices, outs):
            entries = out["meta_info"]["input_token_logprobs"]
            if text and entries and entries[0][1] == last_prompt_token:
                entries = entries[1:]  # still the prompt's own last token: not the choice's
            entries = [entry for entry in entries if entry[0] is not None]
            if not entries:
                raise BackendError(f"select: choice {choice!r} adds no token to the prompt")
            token_logprobs.append([float(lp) for lp, _, *_ in entries])
            token_ids.append([int(token) for _, token, *_ in entries])
        scores = ChoiceScores(choices, token_logprobs, token_ids=token_ids)
        if method.needs_unconditional:
            scores.unconditional = self._unconditional(token_ids)
        return method(scores)

    def _unconditional(self, token_ids: list[list[int]]) -> list[list[float]]:
        outs = self._post({"input_ids": token_ids, "sampling_params": {"max_new_tokens": 0},
                           "return_logprob": True, "logprob_start_len": 0})
        return [[0.0 if lp is None else float(lp) for lp, *_ in out["meta_info"][
            "input_token_logprobs"]] for out in outs]


def _gen_payload(text: str, params: GenParams) -> dict[str, Any]:
    return {"text": text, "sampling_params": params.native_sampling_params(),
            **params.native_logprob_options()}


class EngineBackend(NativeBackend):
    """An in-process :class:`radixlm.Engine`: no HTTP, the same requests."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        tokenizer = engine.tokenizer
        name = str(engine.model_config.path)
        if getattr(tokenizer, "chat_template", None):
            self._template = from_renderer(
                lambda messages: tokenizer.apply_chat_template(messages, tokenize=False), name)
        else:
            self._template = from_renderer(_no_template, name)

    @property
    def chat_template(self) -> ChatTemplate:
        return self._template

    def _post(self, payload: dict[str, Any]) -> Any:
        payload = dict(payload)
        return self.engine.generate(payload.pop("text", None), **payload)

    def _post_stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        payload = dict(payload)
        return self.engine.generate(payload.pop("text", None), **payload)

    def flush_cache(self) -> None:
        self.engine.flush_cache()

    def get_server_info(self) -> dict[str, Any]:
        return self.engine.get_server_info()

    def shutdown(self) -> None:
        self.engine.shutdown()


def _no_template(messages: list[dict[str, str]]) -> str:
    raise ValueError("the tokenizer has no chat template")
