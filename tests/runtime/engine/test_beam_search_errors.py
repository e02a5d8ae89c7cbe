"""Beam search's refusals at the Engine: what a search cannot honour (sampling, penalties,
constraints, stop strings, logprobs, an empty budget) and the beam fields given without
``use_beam_search`` are a ValueError naming the field, raised before anything is queued; the
greedy values of the sampling fields, given explicitly, are accepted."""

from __future__ import annotations

import re

import pytest
from runtime_checks import assert_engine_idle
from workloads import greedy

BEAM = {"use_beam_search": True, "n": 2, "max_new_tokens": 4}

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
def test_what_beam_search_cannot_honour_is_refused_naming_it(
    engine_for, field, sampling, request_fields
):
    engine = engine_for()
    with pytest.raises(ValueError, match=re.escape(field)):
        engine.generate(input_ids=[5, 6, 7, 8], sampling_params=sampling, **request_fields)
    assert_engine_idle(engine)


def test_a_refused_search_in_a_batch_queues_nothing_and_the_engine_keeps_serving(engine_for):
    engine = engine_for()
    with pytest.raises(ValueError, match="temperature"):
        engine.generate(input_ids=[[5, 6, 7], [8, 9, 10]],
                        sampling_params=[greedy(3), {**BEAM, "temperature": 1.0}])
    assert_engine_idle(engine)
    assert engine.generate(input_ids=[5, 6, 7], sampling_params=greedy(3))[
        "meta_info"]["completion_tokens"] == 3


def test_the_greedy_values_given_explicitly_are_accepted(engine_for):
    """temperature 0, top_p 1, top_k -1, min_p 0, no penalties: what beam search does anyway."""
    engine = engine_for()
    plain = engine.generate(input_ids=[5, 6, 7, 8], sampling_params=BEAM)
    explicit = engine.generate(input_ids=[5, 6, 7, 8], sampling_params={
        **BEAM, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
        "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
        "length_penalty": 1.0, "early_stopping": False})
    assert [o["output_ids"] for o in explicit] == [o["output_ids"] for o in plain]
    assert len(plain) == 2


def test_a_search_the_pool_cannot_hold_is_refused_naming_the_width(engine_for):
    """Width x the output budget beyond the pool (8192 slots): refused up front rather than
    waiting forever for room."""
    engine = engine_for()
    with pytest.raises(ValueError, match=r"width 64|n \(64\)"):
        engine.generate(input_ids=[5, 6, 7, 8], sampling_params={
            **BEAM, "n": 64, "max_new_tokens": 400})
    assert_engine_idle(engine)
