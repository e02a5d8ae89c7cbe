"""The primitives a program appends (``gen``, ``select``, roles, ...) and the module-level
helpers (``flush_cache``, ``get_server_info``), as SGLang's frontend names them."""

from __future__ import annotations

import json
import re
from typing import Any

from radixlm.frontend_lang import ir
from radixlm.frontend_lang.backends import resolve_backend
from radixlm.frontend_lang.choices import ChoicesMethod, token_length_normalized


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | str | None = None,
    choices: list[str] | None = None,
    choices_method: ChoicesMethod | None = None,
    regex: str | None = None,
    json_schema: str | dict[str, Any] | None = None,
) -> ir.Expr:
    """Generates text into variable ``name``. Unset options inherit ``run``'s. ``choices``
    makes it a :func:`select`; ``dtype`` (int, float, bool, str), ``regex`` or
    ``json_schema`` constrain the output."""
    if choices is not None:
        return select(name, choices, 0.0 if temperature is None else temperature,
                      choices_method or token_length_normalized)
    _check_name(name)
    if regex is not None:
        try:
            re.compile(regex)
        except (re.error, TypeError) as err:
            raise ValueError(f"regex {regex!r} is not a valid regular expression: {err}") \
                from None
    if json_schema is not None and not isinstance(json_schema, str):
        json_schema = json.dumps(json_schema)
    params = ir.GenParams(
        max_new_tokens=max_tokens, min_new_tokens=min_tokens, n=n, stop=stop,
        stop_token_ids=stop_token_ids, stop_regex=stop_regex, temperature=temperature,
        top_p=top_p, top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty, ignore_eos=ignore_eos, return_logprob=return_logprob,
        logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs, dtype=ir.normalize_dtype(dtype),
        regex=regex, json_schema=json_schema,
    )
    return ir.Gen(name, params)


def gen_int(name: str | None = None, max_tokens: int | None = None, **options: Any) -> ir.Expr:
    """An integer, as text (``-?[0-9]+``)."""
    return gen(name, max_tokens, dtype=int, **options)


def gen_string(name: str | None = None, max_tokens: int | None = None,
               **options: Any) -> ir.Expr:
    """A double-quoted string on one line."""
    return gen(name, max_tokens, dtype=str, **options)


def select(name: str | None = None, choices: list[str] | None = None,
           temperature: float = 0.0,
           choices_method: ChoicesMethod = token_length_normalized) -> ir.Expr:
    """Appends the choice the model finds most likely (by ``choices_method``) and stores it
    in ``name``. All choices are scored in one batched request."""
    _check_name(name)
    if not isinstance(choices, (list, tuple)) or not choices:
        raise ValueError(f"select{f' {name!r}' if name else ''} needs a non-empty list of "
                         f"choices, got {choices!r}")
    if not all(isinstance(choice, str) and choice for choice in choices):
        raise ValueError(f"select choices must be non-empty strings, got {choices!r}")
    if not isinstance(choices_method, ChoicesMethod):
        raise TypeError("choices_method must be token_length_normalized, "
                        "greedy_token_selection or unconditional_likelihood_normalized")
    return ir.Select(name, tuple(choices), float(temperature), choices_method)


def image(path: str) -> ir.Expr:
    return ir.Image(path)


def _check_name(name: Any) -> None:
    if name is not None and not isinstance(name, str):
        raise TypeError(f"a variable name must be a str, got {type(name).__name__}")


def _role(role: str, expr: Any) -> ir.Expr:
    if expr is None:
        return ir.Concat((ir.RoleBegin(role), ir.RoleEnd(role)))
    return ir.RoleBegin(role) + expr + ir.RoleEnd(role)


def system(expr: Any = None) -> ir.Expr:
    return _role("system", expr)


def user(expr: Any = None) -> ir.Expr:
    return _role("user", expr)


def assistant(expr: Any = None) -> ir.Expr:
    return _role("assistant", expr)


def system_begin() -> ir.Expr:
    return ir.RoleBegin("system")


def system_end() -> ir.Expr:
    return ir.RoleEnd("system")


def user_begin() -> ir.Expr:
    return ir.RoleBegin("user")


def user_end() -> ir.Expr:
    return ir.RoleEnd("user")


def assistant_begin() -> ir.Expr:
    return ir.RoleBegin("assistant")


def assistant_end() -> ir.Expr:
    return ir.RoleEnd("assistant")


def flush_cache(backend: Any = None) -> None:
    """Empties the backend's prefix cache."""
    resolve_backend(backend).flush_cache()


def get_server_info(backend: Any = None) -> dict[str, Any]:
    return resolve_backend(backend).get_server_info()
