"""The cost model of a request: how much one call may ask for, checked where it enters.

Every size a request chooses is bounded before anything is queued: the samples it fans out
to (``n`` x prompts), the logprobs it asks for per position and over its prompt, its stop
strings, regexes (and the automaton states those regexes compile to) and stop token ids,
its ``logit_bias`` (and these lists over all of a call's samples, each of which carries
them) and its constraint, and the characters of its prompts (a prompt longer than the
context could ever hold is refused before it is tokenized; a chat counts every part of
its messages and template variables). A request over a limit gets a ``ValueError``
(HTTP 400) naming the limit and the server option that sets it. The limits are
``ServerArgs`` fields; see docs/server.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from radixlm.runtime.detokenizer.stop_regex import MAX_PROGRAM_SIZE
from radixlm.runtime.sampling.sampling_params import SamplingParams

PROMPT_CHARS_PER_TOKEN_SLACK = 4
"""How many characters a prompt may have per character of the vocabulary's longest token
before it is refused untokenized: normalisers may merge or drop some characters (composed
accents, control characters), so the bound leaves room for that."""


@dataclass(frozen=True)
class RequestCaps:
    """The most one request may ask for (the ``ServerArgs`` fields of the same names, which
    hold the defaults)."""

    max_logprobs: int
    """Top logprobs per position (``top_logprobs_num``; OpenAI's ``logprobs`` and
    ``top_logprobs``)."""
    max_n: int
    """Samples per prompt (``n``)."""
    max_samples_per_request: int
    """Prompts x ``n`` in one call."""
    max_prompt_logprob_entries: int
    """Prompt positions with logprobs x (1 + top logprobs) in one prompt."""
    max_stop_strings: int
    """Stop strings plus stop regexes of one prompt."""
    max_stop_chars: int
    """Total characters of a prompt's stop strings and stop regexes."""
    max_stop_token_ids: int
    """Entries of ``stop_token_ids``."""
    max_logit_bias: int
    """Entries of ``logit_bias``."""
    max_constraint_chars: int
    """Characters of a regex, JSON schema or EBNF constraint."""
    max_request_parameter_entries: int
    """Stop token ids, ``logit_bias`` entries and stop characters of all of one call's
    samples together (each sample carries its own to the scheduler)."""

    @classmethod
    def from_options(cls, options: Any) -> RequestCaps:
        """The caps named by ``options``' fields (a ``ServerArgs``)."""
        return cls(**{name: getattr(options, name) for name in cls.__dataclass_fields__})

    def check_samples(self, samples: int) -> None:
        """``samples`` requests (prompts x ``n``) from one call."""
        _at_most("the number of samples (prompts x n)", samples, self.max_samples_per_request,
                 "max_samples_per_request")

    def check_parameter_entries(self, prompts: list[SamplingParams]) -> None:
        """The list parameters of one call's prompts, each counted once per sample."""
        entries = sum(params.n * parameter_entries(params) for params in prompts)
        _at_most("the stop_token_ids, logit_bias entries and stop characters of all samples "
                 "(prompts x n) together", entries, self.max_request_parameter_entries,
                 "max_request_parameter_entries")

    def check_logprobs(self, top_logprobs_num: int, prompt_rows: int) -> None:
        """``top_logprobs_num`` per position, over ``prompt_rows`` prompt positions."""
        _at_most("top_logprobs_num", top_logprobs_num, self.max_logprobs, "max_logprobs")
        _at_most(f"prompt logprobs ({prompt_rows} positions x (1 + {top_logprobs_num}))",
                 prompt_rows * (1 + top_logprobs_num), self.max_prompt_logprob_entries,
                 "max_prompt_logprob_entries")

    def check_params(self, params: SamplingParams) -> None:
        """The sizes chosen in one prompt's sampling parameters."""
        _at_most("n", params.n, self.max_n, "max_n")
        stops = (params.stop or []) + (params.stop_regex or [])
        _at_most("the number of stop strings and stop regexes", len(stops),
                 self.max_stop_strings, "max_stop_strings")
        _at_most("the total length of the stop strings and stop regexes",
                 sum(len(s) for s in stops), self.max_stop_chars, "max_stop_chars")
        states = params.stop_regex_size()  # compiled only once their number is bounded
        if states > MAX_PROGRAM_SIZE:  # matching costs up to this much per character
            raise ValueError(f"the stop regexes compile to {states} NFA states together, "
                             f"over the limit of {MAX_PROGRAM_SIZE} for one prompt")
        _at_most("the number of stop_token_ids", len(params.stop_token_ids or ()),
                 self.max_stop_token_ids, "max_stop_token_ids")
        _at_most("the number of logit_bias entries", len(params.logit_bias or {}),
                 self.max_logit_bias, "max_logit_bias")
        constraint = params.constraint()
        if constraint is not None:
            _at_most(f"the length of the {constraint.kind} constraint", len(constraint.text),
                     self.max_constraint_chars, "max_constraint_chars")


def parameter_entries(params: SamplingParams) -> int:
    """What one sample of ``params`` carries in lists: stop token ids, ``logit_bias`` entries
    and the characters of its stop strings and regexes."""
    stops = (params.stop or []) + (params.stop_regex or [])
    return (len(params.stop_token_ids or ()) + len(params.logit_bias or {})
            + sum(len(s) for s in stops))


def chat_chars(messages: list[dict[str, Any]], template_kwargs: dict[str, Any]) -> int:
    """What a chat brings to its template, in characters: the JSON of its messages (every
    part of each, so a message without content counts too) and of its template variables."""
    return len(json.dumps(messages, default=str)) + len(json.dumps(template_kwargs, default=str))


def longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """Characters of the vocabulary's longest token, as the tokenizer spells it (byte-level
    vocabularies spell a byte as one character, so this bounds the text a token covers)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


def max_prompt_chars(context_length: int, token_chars: int) -> int:
    """The most characters a prompt may have and still fit ``context_length`` tokens."""
    return context_length * max(token_chars, 1) * PROMPT_CHARS_PER_TOKEN_SLACK


def _at_most(what: str, value: int, cap: int, option: str) -> None:
    if value > cap:
        raise ValueError(f"{what} is {value}, over the server's limit of {cap} "
                         f"(the {option} option)")
