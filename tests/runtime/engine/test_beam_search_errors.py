"""Beam search's refusals where a request enters (``build_generate_reqs``, which the Engine,
``/generate`` and the OpenAI routes share): what a search cannot honour (sampling,
penalties, constraints, stop strings, logprobs, an empty budget), the beam fields given
without ``use_beam_search``, a width or a KV need the server cannot hold, and the servers
it does not run on are a ValueError naming the field, before anything is queued; the greedy
values of the sampling fields, given explicitly, are accepted."""

from __future__ import annotations

import dataclasses
import re

import pytest
from runtime_checks import entry_limits

from radixlm.runtime.engine.request_inputs import GenerateInput, RequestLimits, build_generate_reqs

LIMITS = entry_limits(request_rows=64)
BEAM = {"use_beam_search": True, "n": 2, "max_new_tokens": 4}


def enter(sampling, limits: RequestLimits = LIMITS, **fields):
    """The messages a request becomes (raises what the entry raises)."""
    request = GenerateInput(input_ids=[5, 6, 7, 8], sampling_params=sampling, **fields)
    return build_generate_reqs(request, tokenizer=None, limits=limits)[0]


REFUSED = [
    ("temperature", {**BEAM, "temperature": 0.7}, {}),
    ("top_p", {**BEAM, "top_p": 0.9}, {}),
    ("top_k", {**BEAM, "top_k": 5}, {}),
    ("min_p", {**BEAM, "min_p": 0.1}, {}),
    ("frequency_penalty", {**BEAM, "frequency_penalty": 0.5}, {}),
    ("presence_penalty", {**BEAM, "presence_penalty": 0.5}, {}),
    ("repetition_penalty", {**BEAM, "repetition_penalty": 1.2}, {}),
    ("sampling_seed", {**BEAM, "sampling_seed": 1}, {}),
    ("logit_bias", {**BEAM, "logit_bias": {"5": 2.0}}, {}),
    ("regex", {**BEAM, "regex": "[a-z]+"}, {}),
    ("json_schema", {**BEAM, "json_schema": '{"type": "object"}'}, {}),
    ("ebnf", {**BEAM, "ebnf": 'root ::= "a"'}, {}),
    ("stop", {**BEAM, "stop": ["fox"]}, {}),
    ("stop_regex", {**BEAM, "stop_regex": ["f.x"]}, {}),
    ("max_new_tokens", {**BEAM, "max_new_tokens": 0}, {}),
    ("return_logprob", BEAM, {"return_logprob": True}),
    ("length_penalty", {"n": 2, "max_new_tokens": 4, "length_penalty": 2.0}, {}),
    ("early_stopping", {"max_new_tokens": 4, "early_stopping": True}, {}),
    ("early_stopping", {**BEAM, "early_stopping": "always"}, {}),
    ("use_beam_search", {**BEAM, "use_beam_search": "yes"}, {}),
]


@pytest.mark.parametrize(("field", "sampling", "request_fields"), REFUSED,
                         ids=[f"{i}-{case[0]}" for i, case in enumerate(REFUSED)])
def test_what_beam_search_cannot_honour_is_refused_naming_it(field, sampling, request_fields):
    with pytest.raises(ValueError, match=re.escape(field)):
        enter(sampling, **request_fields)


def test_the_greedy_values_given_explicitly_are_accepted():
    """temperature 0, top_p 1, top_k -1, min_p 0, no penalties: what beam search does anyway;
    the search becomes its n members, the first leading."""
    messages = enter({**BEAM, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                      "frequency_penalty": 0.0, "presence_penalty": 0.0,
                      "repetition_penalty": 1.0, "length_penalty": 1.0,
                      "early_stopping": False}, rid="search")
    assert [m.rid for m in messages] == ["search-0", "search-1"]
    assert [m.prefill_leader for m in messages] == [None, "search-0"]
    assert all(m.sampling.use_beam_search for m in messages)


@pytest.mark.parametrize(("limits", "sampling", "message"), [
    (LIMITS, {**BEAM, "n": 64, "max_new_tokens": 400}, r"width 64"),
    (dataclasses.replace(LIMITS, request_rows=4), {**BEAM, "n": 8}, r"n \(8\)"),
    (dataclasses.replace(LIMITS, disaggregation_mode="prefill"), BEAM, "disaggregated"),
    (dataclasses.replace(LIMITS, tp_size=2, page_size=4), BEAM, "tensor parallelism"),
], ids=["kv", "rows", "disaggregated", "tp-pages"])
def test_what_the_server_cannot_run_is_refused_up_front(limits, sampling, message):
    """A search the pool or the request rows cannot hold would wait forever: refused, as
    are the servers it does not run on."""
    with pytest.raises(ValueError, match=message):
        enter(sampling, limits)


def test_tensor_parallelism_with_single_token_pages_is_accepted():
    assert len(enter(BEAM, dataclasses.replace(LIMITS, tp_size=2))) == 2
