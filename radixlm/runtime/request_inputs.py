"""The prompt forms ``generate`` accepts, checked and brought to one shape: a list of items."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase


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
