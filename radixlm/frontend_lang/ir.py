"""The intermediate representation of a program: what ``s += ...`` appends.

A program is Python code that appends expressions to a state. Each expression is a small
immutable dataclass; ``a + b`` builds a :class:`Concat`, so ``s += "Q: " + gen("a")`` is one
append. The executor (``executor.py``) runs expressions in order against a backend; the tracer
(``tracer.py``) runs them against nothing to find a program's constant prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

DTYPE_REGEXES: dict[str, str] = {
    "int": r"-?(0|[1-9][0-9]{0,17})",
    "float": r"-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,8})?",
    "bool": r"(True|False)",
    "str": r'"[^"\\\n]{0,256}"',
}
"""``gen(dtype=...)`` constrains the output with these regexes; values stay strings."""


@dataclass(frozen=True)
class GenParams:
    """Sampling options of one ``gen`` (or of a whole ``run``); ``None`` means inherit.

    ``merged_over(defaults)`` fills every ``None`` from ``defaults``; the executor merges a
    gen's own options over the run's, so a gen argument always wins.
    """

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    dtype: str | None = None
    regex: str | None = None
    json_schema: str | None = None

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPE_REGEXES:
            raise ValueError(f"dtype must be one of int, float, bool, str; got {self.dtype!r}")
        constraints = [k for k in ("dtype", "regex", "json_schema") if getattr(self, k)]
        if len(constraints) > 1:
            raise ValueError(f"gen takes at most one of dtype, regex, json_schema; got "
                             f"{constraints}")

    def merged_over(self, defaults: GenParams) -> GenParams:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in values.items():
            if value is None:
                values[name] = getattr(defaults, name)
        if self.dtype or self.regex or self.json_schema:  # the gen's own constraint wins
            values.update(dtype=self.dtype, regex=self.regex, json_schema=self.json_schema)
        return GenParams(**values)

    @property
    def effective_regex(self) -> str | None:
        return DTYPE_REGEXES[self.dtype] if self.dtype else self.regex

    def native_sampling_params(self) -> dict[str, Any]:
        """The native API's ``sampling_params`` dict (only the options that are set)."""
        names = ("max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "stop_regex",
                 "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                 "presence_penalty", "ignore_eos", "json_schema")
        params = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        if self.effective_regex:
            params["regex"] = self.effective_regex
        return params

    def native_logprob_options(self) -> dict[str, Any]:
        """The request-level logprob fields of the native API (only the ones that are set)."""
        if not self.return_logprob:
            return {}
        options: dict[str, Any] = {"return_logprob": True}
        for name in ("logprob_start_len", "top_logprobs_num", "return_text_in_logprobs"):
            if getattr(self, name) is not None:
                options[name] = getattr(self, name)
        return options


def normalize_dtype(dtype: type | str | None) -> str | None:
    """``int``, ``"int"`` and friends become the names of :data:`DTYPE_REGEXES`."""
    if dtype is None:
        return None
    name = dtype.__name__ if isinstance(dtype, type) else dtype
    if name not in DTYPE_REGEXES:
        raise ValueError(f"dtype must be int, float, bool or str; got {dtype!r}")
    return name


class Expr:
    """Base of every expression; ``+`` concatenates."""

    def __add__(self, other: Any) -> Concat:
        return Concat((self, as_expr(other)))

    def __radd__(self, other: Any) -> Concat:
        return Concat((as_expr(other), self))


@dataclass(frozen=True)
class Constant(Expr):
    """Literal text."""

    text: str


@dataclass(frozen=True)
class Concat(Expr):
    """Expressions run one after another."""

    parts: tuple[Expr, ...]

    def __add__(self, other: Any) -> Concat:
        return Concat((*self.parts, as_expr(other)))


@dataclass(frozen=True)
class Gen(Expr):
    """Generate text into variable ``name`` (``None``: append without storing)."""

    name: str | None
    params: GenParams = field(default_factory=GenParams)


@dataclass(frozen=True)
class Select(Expr):
    """Pick one of ``choices`` by the model's likelihood and append it."""

    name: str | None
    choices: tuple[str, ...]
    temperature: float
    choices_method: Any


@dataclass(frozen=True)
class RoleBegin(Expr):
    role: str


@dataclass(frozen=True)
class RoleEnd(Expr):
    role: str


@dataclass(frozen=True)
class Image(Expr):
    path: str


@dataclass(frozen=True)
class VarScopeBegin(Expr):
    name: str


@dataclass(frozen=True)
class VarScopeEnd(Expr):
    name: str


@dataclass(frozen=True)
class Argument(Expr):
    """A program argument while tracing: its value is unknown, so tracing stops here."""

    name: str

    def __str__(self) -> str:
        raise TracingStop(f"argument {self.name!r} is used as a Python value")


class TracingStop(Exception):
    """Raised to end tracing where a program's text stops being constant."""


def as_expr(value: Any) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Constant(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return Constant(str(value))
    raise TypeError(f"cannot append a {type(value).__name__} to a program state; use a str "
                    "or a radixlm expression (gen, select, roles, ...)")


def flatten(expr: Expr) -> list[Expr]:
    """The leaf expressions of ``expr`` in execution order."""
    if isinstance(expr, Concat):
        return [leaf for part in expr.parts for leaf in flatten(part)]
    return [expr]
