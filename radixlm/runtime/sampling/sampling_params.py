"""Sampling parameters of one request, as the SGLang native API names them.

A msgspec Struct: validated once, where a request enters (``from_dict``), it then crosses
the process boundary as itself (msgpack) and reaches the scheduler's ``Req`` unchanged.
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec

from radixlm.runtime.detokenizer.stop_regex import compile_stop_regex
from radixlm.runtime.grammar.constraints import CONSTRAINT_KINDS, GrammarKey

GREEDY_TEMPERATURE = 1e-6
"""A temperature below this means greedy decoding."""

INT64_MAX = 2**63 - 1
"""The largest integer any count or id may take (what crosses to the scheduler and into its
tensors is a 64-bit integer)."""
SEED_MAX = 2**64 - 1
"""The largest ``sampling_seed`` (a torch generator takes 64-bit unsigned seeds)."""
TOP_K_MAX = 2**31 - 1
"""The largest ``top_k``: any value at or above the vocabulary's size keeps all of it."""
LENGTH_PENALTY_LIMIT = 10.0
"""Beam search's ``length_penalty`` lies within this of 0 (typical values are 0.5 to 2; at
10 a 10-token hypothesis's score is already scaled 1e10 times)."""


MAX_REASONING_END_IDS = 32
"""The longest end-of-thinking sequence a thinking budget forces: the batch's budget
window is as wide as its longest (a tag of a few tokens in practice)."""


class SamplingParams(msgspec.Struct, kw_only=True):
    """How to pick the next tokens and when to stop.

    Build from user input with ``from_dict``, which rejects unknown keys, validates ranges
    (raising ``ValueError`` naming the field and what is allowed) and normalises (a lone
    stop string becomes a list, a JSON schema given as a dict becomes its text). Whether a
    constraint parses is the grammar backend's to say (``grammar.factory``): this value
    object calls no backend. Direct construction does not validate: it is for values
    already checked.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    n: int = 1
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: list[str] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    regex: str | None = None
    json_schema: str | None = None
    """A JSON schema as a JSON string (``from_dict`` turns a dict into one)."""
    ebnf: str | None = None
    structural_tag: str | None = None
    """An xgrammar structural tag as a JSON string (SGLang's field; a dict becomes one): the
    tool-call grammars of the chat APIs (``output_parsing``)."""
    max_reasoning_tokens: int | None = None
    """A thinking budget: once this many tokens were written before the end of the reasoning
    (``reasoning_end_token_ids``), those ids are forced next. None: no budget."""
    reasoning_end_token_ids: list[int] | None = None
    """The token ids that end the reasoning (``</think>``'s), set by the chat APIs from the
    server's reasoning parser."""
    use_beam_search: bool = False
    """Beam search of width ``n`` (``sampling/beam_search.py``): the ``n`` best outputs."""
    length_penalty: float = 1.0
    """Beam search: a finished output scores its logprob sum / its length ** this."""
    early_stopping: bool | str = False
    """Beam search: True, False or "never", with transformers' meaning."""

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None,
                  compile_regexes: bool = True) -> SamplingParams:
        """Validated params from the API's dict (None: the defaults). ``compile_regexes``
        False leaves the stop regexes unchecked, for a caller that first bounds how many
        there are and then calls ``stop_regex_size``."""
        if params is None:
            return cls()
        if not isinstance(params, dict):
            raise ValueError(f"sampling_params must be a dict, got {type(params).__name__}")
        unknown = sorted(set(params) - set(cls.__struct_fields__))
        if unknown:
            raise ValueError(f"unknown sampling parameters {unknown}; "
                             f"known: {sorted(cls.__struct_fields__)}")
        built = cls(**params)
        built._validate()
        if compile_regexes:
            built.stop_regex_size()
        return built

    def _validate(self) -> None:
        _check_int("max_new_tokens", self.max_new_tokens, minimum=0)
        _check_int("min_new_tokens", self.min_new_tokens, minimum=0,
                   maximum=self.max_new_tokens)
        _check_int("n", self.n, minimum=1)
        _check_int("top_k", self.top_k, minimum=-1, maximum=TOP_K_MAX)
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (disabled) or a positive integer, got 0")
        _check_number("temperature", self.temperature, low=0.0)
        _check_number("top_p", self.top_p, low=0.0, high=1.0)
        if self.top_p <= 0.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_number("min_p", self.min_p, low=0.0, high=1.0)
        _check_number("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _check_number("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_number("repetition_penalty", self.repetition_penalty, low=0.0)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        self.stop = _string_list("stop", self.stop)
        self.stop_regex = _string_list("stop_regex", self.stop_regex)
        if self.stop_token_ids is not None and not (
            isinstance(self.stop_token_ids, list)
            and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT64_MAX
                    for t in self.stop_token_ids)
        ):
            raise ValueError("stop_token_ids must be a list of token ids (non-negative "
                             "integers)")
        if self.sampling_seed is not None:
            _check_int("sampling_seed", self.sampling_seed, minimum=0, maximum=SEED_MAX)
        if self.logit_bias is not None:
            self._check_logit_bias()
        self._check_constraint()
        self._check_beam_search()
        self._check_reasoning_budget()

    def stop_regex_size(self) -> int:
        """The NFA states of all the stop regexes together (each compiled once, then
        cached); raises ``ValueError`` naming a pattern that is refused."""
        total = 0
        for pattern in self.stop_regex or []:
            try:
                total += len(compile_stop_regex(pattern).ops)
            except ValueError as err:
                raise ValueError(f"stop_regex {pattern!r} is refused: {err}") from None
        return total

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty) or (
            self.repetition_penalty != 1.0
        )

    def constraint(self) -> GrammarKey | None:
        """The constraint on the output, if any."""
        for kind in CONSTRAINT_KINDS:
            text = getattr(self, kind)
            if text is not None:
                return GrammarKey(kind, text)
        return None

    def check_vocab(self, vocab_size: int, eos_token_ids: frozenset[int] = frozenset()) -> None:
        """Token ids named in the parameters must exist in the vocabulary, and before
        ``min_new_tokens`` some token must be allowed: not all of them may stop the output
        (``stop_token_ids`` and, unless ``ignore_eos``, the model's ``eos_token_ids``)."""
        ids = list(self.stop_token_ids or [])
        ids += [int(t) for t in (self.logit_bias or {})]
        ids += list(self.reasoning_end_token_ids or [])
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} in stop_token_ids/logit_bias/"
                             "reasoning_end_token_ids are outside "
                             f"the vocabulary (size {vocab_size})")
        stopping = set(self.stop_token_ids or ()) | (set() if self.ignore_eos
                                                     else set(eos_token_ids))
        if self.min_new_tokens and len(stopping & set(range(vocab_size))) == vocab_size:
            raise ValueError("stop_token_ids (with the model's EOS tokens) cover the whole "
                             "vocabulary: no token could be generated before min_new_tokens")

    def _check_constraint(self) -> None:
        """At most one constraint (``CONSTRAINT_KINDS``), given as a non-empty string."""
        if isinstance(self.json_schema, dict):
            self.json_schema = json.dumps(self.json_schema)
        if isinstance(self.structural_tag, dict):
            self.structural_tag = json.dumps(self.structural_tag)
        given = [kind for kind in CONSTRAINT_KINDS if getattr(self, kind) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of {', '.join(CONSTRAINT_KINDS)}, got {given}")
        if not given:
            return
        kind = given[0]
        text = getattr(self, kind)
        if not isinstance(text, str) or not text:
            raise ValueError(f"{kind} must be a non-empty string, got {text!r}")

    def _check_beam_search(self) -> None:
        """Beam search's own fields have their types; without it, they keep their defaults
        (a request that sets them and forgets ``use_beam_search`` is told so)."""
        if not isinstance(self.use_beam_search, bool):
            raise ValueError(f"use_beam_search must be true or false, got {self.use_beam_search!r}")
        _check_number("length_penalty", self.length_penalty, low=-LENGTH_PENALTY_LIMIT,
                      high=LENGTH_PENALTY_LIMIT)
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError("early_stopping must be true, false or \"never\", got "
                             f"{self.early_stopping!r}")
        if self.use_beam_search:
            if self.max_new_tokens == 0:
                raise ValueError("max_new_tokens must be >= 1 with use_beam_search")
            return
        for name, default in (("length_penalty", 1.0), ("early_stopping", False)):
            if getattr(self, name) != default:
                raise ValueError(f"{name} applies to beam search only: set use_beam_search "
                                 "(with n, the beam width)")

    def _check_reasoning_budget(self) -> None:
        """A budget counts tokens, and needs the ids it forces when it runs out."""
        ids = self.reasoning_end_token_ids
        if ids is not None and not (
            isinstance(ids, list) and ids
            and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT64_MAX
                    for t in ids)
        ):
            raise ValueError("reasoning_end_token_ids must be a non-empty list of token ids "
                             "(non-negative integers)")
        if ids is not None and len(ids) > MAX_REASONING_END_IDS:
            raise ValueError(f"reasoning_end_token_ids has {len(ids)} ids, over the limit of "
                             f"{MAX_REASONING_END_IDS} (every running request's budget "
                             "window is that wide)")
        if self.max_reasoning_tokens is None:
            return
        _check_int("max_reasoning_tokens", self.max_reasoning_tokens, minimum=0)
        if ids is None:
            raise ValueError("max_reasoning_tokens needs reasoning_end_token_ids (the ids "
                             "forced when the budget runs out)")

    def beam_search_conflicts(self, given: set[str]) -> list[str]:
        """The parameters among ``given`` (those the caller set) that beam search cannot
        honour: it picks tokens deterministically, unconstrained, on raw logprobs."""
        if not self.use_beam_search:
            return []
        defaults = SamplingParams()
        conflicts = [name for name in ("top_p", "top_k", "min_p", "frequency_penalty",
                                       "presence_penalty", "repetition_penalty",
                                       "sampling_seed", "logit_bias", "stop", "stop_regex",
                                       "regex", "json_schema", "ebnf", "structural_tag",
                                       "max_reasoning_tokens")
                     if name in given and getattr(self, name) != getattr(defaults, name)]
        if "temperature" in given and not self.is_greedy:
            conflicts.insert(0, "temperature")
        return conflicts

    def _check_logit_bias(self) -> None:
        """Token ids (as JSON gives them: strings, or ints from Python) to biases in
        [-100, 100]; the keys are normalised to decimal strings."""
        if not isinstance(self.logit_bias, dict):
            raise ValueError("logit_bias must map token ids to biases")
        normalised = {}
        for token, bias in self.logit_bias.items():
            try:
                token_id = int(token)
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias key {token!r} is not a token id") from None
            _check_number(f"logit_bias[{token!r}]", bias, low=-100.0, high=100.0)
            normalised[str(token_id)] = bias
        self.logit_bias = normalised


def _string_list(name: str, value: Any) -> list[str] | None:
    """None, or a non-empty list of non-empty strings (a lone string becomes a list)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{name} must be a non-empty string or a list of non-empty strings")
    return value


def _check_int(name: str, value: Any, minimum: int, maximum: int = INT64_MAX) -> None:
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if not is_int or not minimum <= value <= maximum:
        wide = maximum == INT64_MAX and not (is_int and value > maximum)
        bounds = f">= {minimum}" if wide else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be an integer {bounds}, got {value!r}")


def _check_number(name: str, value: Any, low: float, high: float = math.inf) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not low <= value <= high:
        bounds = f">= {low}" if high == math.inf else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bounds}, got {value}")
