"""The prompt forms ``generate`` accepts, checked and brought to one shape: a list of items."""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from radixlm.kv_cache.allocator import pages_for
from radixlm.runtime import messages as io
from radixlm.runtime.sampling.sampling_params import SamplingParams


@dataclass
class RequestInput:
    input_ids: list[int]
    sampling_params: dict[str, Any] | None
    rid: str


@dataclass
class RequestInputs:
    items: list[RequestInput]
    batched: bool
    """True when the caller passed a list of prompts (and so gets a list back)."""

    def __iter__(self):
        return iter(self.items)


def normalize_inputs(
    prompt: str | list[str] | None,
    input_ids: list[int] | list[list[int]] | None,
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None,
    rid: str | list[str] | None,
    tokenizer: PreTrainedTokenizerBase,
    context_length: int,
    vocab_size: int,
) -> RequestInputs:
    """Tokenizes text prompts and checks every prompt against the context and vocabulary.

    Raises ``ValueError`` naming the argument for: both or neither of ``prompt`` and
    ``input_ids``, empty prompts, ids outside the vocabulary, prompts that fill the
    context, and list lengths that do not match.
    """
    if (prompt is None) == (input_ids is None):
        raise ValueError("pass exactly one of prompt and input_ids")
    if prompt is not None:
        batched = isinstance(prompt, list)
        texts = prompt if batched else [prompt]
        if not all(isinstance(t, str) for t in texts):
            raise ValueError("prompt must be a string or a list of strings")
        id_lists = [tokenizer.encode(t) for t in texts]
        name = "prompt"
    else:
        batched = bool(input_ids) and isinstance(input_ids[0], list)
        id_lists = input_ids if batched else [input_ids]
        for ids in id_lists:
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise ValueError("input_ids must be a list of ints or a list of lists of ints")
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(
                    f"input_ids {bad[:5]} are outside the vocabulary (size {vocab_size})"
                )
        name = "input_ids"
    if batched and not id_lists:
        raise ValueError(f"{name} is an empty list")
    for ids in id_lists:
        if not ids:
            raise ValueError(f"{name} is empty: a request needs at least one prompt token")
        if len(ids) >= context_length:
            raise ValueError(
                f"{name} has {len(ids)} tokens; the context length is {context_length}, "
                "so a prompt may have at most context_length - 1 tokens"
            )
    params_list = _per_item("sampling_params", sampling_params, len(id_lists), dict)
    rids = _per_item("rid", rid, len(id_lists), str)
    items = [
        RequestInput(list(ids), params, r or uuid.uuid4().hex)
        for ids, params, r in zip(id_lists, params_list, rids)
    ]
    return RequestInputs(items, batched)


def _per_item(name: str, value: Any, count: int, item_type: type) -> list[Any]:
    """One value for all items, or a list with one per item."""
    if isinstance(value, list):
        if len(value) != count:
            raise ValueError(f"{name} is a list of {len(value)}, but there are {count} prompts")
        return value
    if value is not None and not isinstance(value, item_type):
        raise ValueError(f"{name} must be a {item_type.__name__} or a list of them")
    return [value] * count


@dataclass
class RequestLimits:
    """What the running model accepts, for checking requests before they are sent."""

    context_length: int
    vocab_size: int
    max_total_tokens: int
    page_size: int
    generation_defaults: dict[str, Any]


def build_generate_reqs(
    inputs: RequestInputs, limits: RequestLimits, return_logprob: bool,
    logprob_start_len: int | None, top_logprobs_num: int | None,
    return_text_in_logprobs: bool, extra_key: str | None,
) -> list[io.GenerateReq]:
    """The scheduler's messages for ``inputs``: one per sample (``n`` per prompt).

    Every value is checked here, before anything is queued, so a bad one queues nothing.
    The model's generation-config defaults fill in what the request leaves out. A
    ``max_new_tokens`` given beyond the context is refused (as SGLang does); the default
    budget is clamped to the context.
    """
    if top_logprobs_num is not None and (
        not isinstance(top_logprobs_num, int) or top_logprobs_num < 0
    ):
        raise ValueError(f"top_logprobs_num must be an integer >= 0, got {top_logprobs_num!r}")
    if extra_key is not None and not isinstance(extra_key, str):
        raise ValueError(f"extra_key must be a string, got {type(extra_key).__name__}")
    messages = []
    for item in inputs:
        params = SamplingParams.from_dict(
            {**limits.generation_defaults, **(item.sampling_params or {})}
        )
        params.check_vocab(limits.vocab_size)
        prompt_len = len(item.input_ids)
        room = limits.context_length - prompt_len
        if "max_new_tokens" in (item.sampling_params or {}) and params.max_new_tokens > room:
            raise ValueError(
                f"max_new_tokens ({params.max_new_tokens}) plus the prompt ({prompt_len} "
                f"tokens) exceeds the context length ({limits.context_length})"
            )
        params.max_new_tokens = min(params.max_new_tokens, room)  # a default budget is clamped
        need = pages_for(prompt_len + params.max_new_tokens, limits.page_size)
        if need > limits.max_total_tokens:
            raise ValueError(
                f"the prompt ({prompt_len} tokens) plus max_new_tokens ({params.max_new_tokens}) "
                f"needs {need} KV slots; the pool holds {limits.max_total_tokens} "
                "(raise max_total_tokens or lower max_new_tokens)"
            )
        start = _logprob_start(logprob_start_len, prompt_len) if return_logprob else None
        for sample in range(params.n):
            fields = dataclasses.asdict(params)
            if params.sampling_seed is not None:
                fields["sampling_seed"] = params.sampling_seed + sample
            messages.append(io.GenerateReq(
                rid=item.rid if params.n == 1 else f"{item.rid}-{sample}",
                input_ids=item.input_ids,
                sampling=fields,
                logprob_start=start,
                return_logprob=return_logprob,
                top_logprobs_num=top_logprobs_num or 0,
                return_text_in_logprobs=return_text_in_logprobs,
                extra_key=extra_key,
                prefill_leader=f"{item.rid}-0" if sample > 0 else None,
            ))
    return messages


def _logprob_start(logprob_start_len: int | None, prompt_len: int) -> int | None:
    if logprob_start_len is None or logprob_start_len == -1:
        return None
    if not isinstance(logprob_start_len, int) or not 0 <= logprob_start_len < prompt_len:
        raise ValueError(
            f"logprob_start_len must be -1 (output only) or in [0, {prompt_len}) for a "
            f"{prompt_len}-token prompt, got {logprob_start_len!r}"
        )
    return logprob_start_len
