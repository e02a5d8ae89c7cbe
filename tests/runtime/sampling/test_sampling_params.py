"""SamplingParams.from_dict and the entry's checks: every bad value is refused by name where
a request enters; good values pass through."""

from __future__ import annotations

import json
import re

import pytest
from runtime_checks import entry_limits

from radixlm.runtime.engine.request_inputs import GenerateInput, build_generate_reqs
from radixlm.runtime.grammar.constraints import GrammarKey
from radixlm.runtime.sampling.sampling_params import SamplingParams

LIMITS = entry_limits()


def entry_params(params: dict) -> SamplingParams:
    """The params a request with ``params`` is queued with, checked as the entry checks it."""
    request = GenerateInput(input_ids=[1, 2, 3], sampling_params=params)
    reqs, _ = build_generate_reqs(request, tokenizer=None, limits=LIMITS)
    return reqs[0].sampling

BAD_PARAMS = [
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"max_new_tokens": 2.5}, "max_new_tokens"),
    ({"min_new_tokens": -1}, "min_new_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3.0}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"n": 1.5}, "n"),
    ({"n": "2"}, "n"),
    ({"n": 0}, "n"),
    ({"n": True}, "n"),
    ({"stop_regex": "(unclosed"}, "stop_regex"),
    ({"stop_regex": ["ok", "[a-"]}, "stop_regex"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", 3]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logit_bias": {"not-a-token": 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 1000.0}}, "logit_bias"),
    ({"sampling_seed": -1}, "sampling_seed"),
    ({"regex": "foo**"}, "regex"),
    ({"regex": "(unclosed"}, "regex"),
    ({"regex": ""}, "regex"),
    ({"json_schema": "{not json"}, "json_schema"),
    ({"json_schema": '{"type": "nonsense"}'}, "json_schema"),
    ({"json_schema": "[1, 2]"}, "json_schema"),
    ({"ebnf": "root ::= undefined_rule"}, "ebnf"),
    ({"ebnf": 'root ::= "a'}, "ebnf"),
    ({"regex": "a+", "json_schema": '{"type": "object"}'}, "regex"),
    ({"regex": "a+", "ebnf": 'root ::= "a"'}, "ebnf"),
    ({"bogus_option": 1}, "bogus_option"),
]


@pytest.mark.parametrize(("params", "field"), BAD_PARAMS, ids=[str(p) for p, _ in BAD_PARAMS])
def test_bad_value_raises_value_error_naming_the_field(params, field):
    # The field as a whole word: "n" must not be satisfied by the "n" in "integer".
    with pytest.raises(ValueError, match=rf"(^|\W){re.escape(field)}(\W|$)"):
        entry_params(params)


def test_non_dict_sampling_params_is_refused():
    with pytest.raises(ValueError, match="sampling_params"):
        SamplingParams.from_dict([("max_new_tokens", 3)])


GOOD_PARAMS = [
    {},
    {"max_new_tokens": 0},
    {"temperature": 0.0},
    {"temperature": 0.7, "top_p": 1.0, "top_k": -1, "min_p": 0.0},
    {"top_p": 0.01, "top_k": 1, "min_p": 1.0},
    {"frequency_penalty": -2.0, "presence_penalty": 2.0, "repetition_penalty": 1.3},
    {"n": 3, "sampling_seed": 0},
    {"stop": ["a", "bc"], "stop_token_ids": [0, 5], "stop_regex": r"\d+"},
    {"logit_bias": {"5": -100.0, 7: 100.0}},
    {"ignore_eos": True, "no_stop_trim": True, "skip_special_tokens": False},
    {"regex": r"[a-z]+@[a-z]+\.com"},
    {"json_schema": '{"type": "object", "properties": {"a": {"type": "integer"}}}'},
    {"ebnf": 'root ::= "yes" | "no"'},
]


@pytest.mark.parametrize("params", GOOD_PARAMS, ids=[str(p) for p in GOOD_PARAMS])
def test_good_values_are_kept(params):
    built = entry_params(params)
    for key, value in params.items():
        if key == "logit_bias":  # keys as decimal strings, as JSON gives them
            assert built.logit_bias == {str(token): bias for token, bias in value.items()}
        elif key not in ("stop", "stop_regex"):
            assert getattr(built, key) == value


def test_none_gives_the_defaults():
    assert SamplingParams.from_dict(None) == SamplingParams()


@pytest.mark.parametrize(
    ("field", "given", "expected"),
    [
        ("stop", "END", ["END"]),
        ("stop", ["a", "b"], ["a", "b"]),
        ("stop_regex", r"\d+", [r"\d+"]),
    ],
)
def test_a_single_stop_string_becomes_a_list(field, given, expected):
    assert getattr(SamplingParams.from_dict({field: given}), field) == expected


@pytest.mark.parametrize(
    ("temperature", "greedy"), [(0.0, True), (1e-7, True), (1e-5, False), (1.0, False)]
)
def test_temperature_below_threshold_means_greedy(temperature, greedy):
    assert SamplingParams.from_dict({"temperature": temperature}).is_greedy is greedy


@pytest.mark.parametrize(
    ("params", "bad"),
    [({"stop_token_ids": [10, 400]}, "400"), ({"logit_bias": {"384": 1.0}}, "384")],
)
def test_token_ids_outside_the_vocabulary_are_refused(params, bad):
    built = SamplingParams.from_dict(params)
    built.check_vocab(1000)
    with pytest.raises(ValueError, match=bad):
        built.check_vocab(384)


@pytest.mark.parametrize("field", ["stop", "stop_regex", "stop_token_ids"])
def test_a_scalar_where_a_list_is_expected_is_refused_by_name(field):
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict({field: 5})


def test_a_json_schema_dict_becomes_a_json_string():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    built = SamplingParams.from_dict({"json_schema": schema})
    assert json.loads(built.json_schema) == schema
    assert built.constraint() == GrammarKey("json_schema", built.json_schema)


def test_constraint_names_the_one_given():
    assert SamplingParams.from_dict({}).constraint() is None
    assert SamplingParams.from_dict({"regex": "a|b"}).constraint() == GrammarKey("regex", "a|b")


def test_the_value_object_checks_shape_and_leaves_parsing_to_the_grammar_backend():
    """A constraint that only the grammar backend can judge passes ``from_dict`` (it calls no
    backend) and is refused where the request enters."""
    assert SamplingParams.from_dict({"regex": "foo**"}).regex == "foo**"
    with pytest.raises(ValueError, match="regex"):
        entry_params({"regex": "foo**"})


@pytest.mark.parametrize(("params", "problem"), [
    ({"regex": "foo**"}, "repetition"),
    ({"regex": "(abc"}, "parenthesis"),
    ({"json_schema": '{"type": "nonsense"}'}, "nonsense"),
    ({"ebnf": "root ::= undefined_rule"}, "undefined_rule"),
])
def test_a_bad_constraint_names_the_problem_without_a_source_location(params, problem):
    with pytest.raises(ValueError, match=problem) as caught:
        entry_params(params)
    assert ".cc:" not in str(caught.value)
