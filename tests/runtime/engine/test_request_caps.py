"""The cost model of a request (``request_caps.py``): whatever a request chooses to ask for is
bounded where it enters, with a 400-style ``ValueError`` naming the limit and its option."""

from __future__ import annotations

import dataclasses

import pytest
from tiny_models import tiny_tokenizer

from radixlm.runtime.engine.request_caps import (
    RequestCaps,
    chat_chars,
    longest_token_chars,
    max_prompt_chars,
)
from radixlm.runtime.engine.request_inputs import (
    GenerateInput,
    RequestLimits,
    build_generate_reqs,
)
from radixlm.runtime.grammar.factory import constraint_checker
from radixlm.runtime.server_args import REQUEST_CAPS, ServerArgs

CAPS = RequestCaps.from_options(ServerArgs())
LIMITS = RequestLimits(context_length=8192, vocab_size=1000, max_total_tokens=1 << 20,
                       page_size=1, generation_defaults={},
                       check_constraint=constraint_checker("xgrammar"), caps=CAPS,
                       max_prompt_chars=50_000)


def build(limits: RequestLimits = LIMITS, tokenizer=None, **fields):
    request = GenerateInput(**{"input_ids": [1, 2, 3], **fields})
    return build_generate_reqs(request, tokenizer, limits)[0]


OVER_THE_CAPS = [
    ("top_logprobs", dict(return_logprob=True, top_logprobs_num=21), "max_logprobs"),
    ("top_logprobs_without_return_logprob", dict(top_logprobs_num=100_000), "max_logprobs"),
    ("prompt_logprob_entries", dict(input_ids=[1] * 7000, return_logprob=True,
                                    logprob_start_len=0, top_logprobs_num=20),
     "max_prompt_logprob_entries"),
    ("n", dict(sampling_params={"n": 129}), "max_n"),
    ("samples", dict(input_ids=[[1, 2]] * 40, sampling_params={"n": 128}),
     "max_samples_per_request"),
    ("prompts", dict(input_ids=[[1, 2]] * 5000), "max_samples_per_request"),
    ("stop_strings", dict(sampling_params={"stop": ["x"] * 40, "stop_regex": ["y"] * 25}),
     "max_stop_strings"),
    ("stop_chars", dict(sampling_params={"stop": ["x" * 3000, "y" * 1097]}), "max_stop_chars"),
    ("logit_bias", dict(sampling_params={"logit_bias": {str(t): 1.0 for t in range(1025)}}),
     "max_logit_bias"),
    ("stop_token_ids", dict(sampling_params={"stop_token_ids": [5] * 1025}),
     "max_stop_token_ids"),
    ("stop_token_ids_times_n", dict(sampling_params={"stop_token_ids": list(range(2000)),
                                                     "n": 16}), "max_stop_token_ids"),
    ("constraint", dict(sampling_params={"regex": "a" * 131073}), "max_constraint_chars"),
    # each list under its own cap, but multiplied by the samples that carry it
    ("stop_token_ids_x_n", dict(sampling_params={"stop_token_ids": [5] * 1024, "n": 128},
                                input_ids=[[1, 2]] * 3), "max_request_parameter_entries"),
    ("logit_bias_x_n", dict(sampling_params={"logit_bias": {str(t): 1.0 for t in range(1000)},
                                             "n": 128}, input_ids=[[1, 2]] * 3),
     "max_request_parameter_entries"),
    ("stop_chars_x_prompts", dict(sampling_params={"stop": ["x" * 4000]},
                                  input_ids=[[1, 2]] * 66), "max_request_parameter_entries"),
    ("stop_regex_states", dict(sampling_params={"stop_regex": ["a{1500}", "b{1500}"]}),
     "NFA states"),
]


@pytest.mark.parametrize(("case", "fields", "option"), OVER_THE_CAPS,
                         ids=[c[0] for c in OVER_THE_CAPS])
def test_a_request_over_a_cap_is_refused_naming_the_option(case, fields, option):
    with pytest.raises(ValueError, match=option):
        build(**fields)


AT_THE_CAPS = [
    dict(return_logprob=True, top_logprobs_num=20),
    dict(input_ids=[1] * 4000, return_logprob=True, logprob_start_len=0, top_logprobs_num=0),
    dict(sampling_params={"n": 128}),
    dict(input_ids=[[1, 2]] * 32, sampling_params={"n": 128}),
    dict(sampling_params={"stop": ["x"] * 40, "stop_regex": ["y"] * 24}),
    dict(sampling_params={"stop": ["x" * 3000, "y" * 1096]}),
    dict(sampling_params={"logit_bias": {str(t): 1.0 for t in range(1000)}}),
    dict(sampling_params={"stop_token_ids": [7] * 1024, "n": 4}),
    dict(sampling_params={"stop_token_ids": [7] * 1023, "logit_bias": {"3": 1.0}, "n": 128},
         input_ids=[[1, 2]] * 2),  # 2 x 128 x 1024 entries: 2^18, the cap
]


@pytest.mark.parametrize("fields", AT_THE_CAPS)
def test_a_request_at_the_caps_passes(fields):
    assert build(**fields)


def test_the_caps_are_server_options():
    tight = dataclasses.replace(LIMITS, caps=RequestCaps.from_options(
        ServerArgs(max_logprobs=2, max_n=3)))
    with pytest.raises(ValueError, match="max_logprobs"):
        build(tight, return_logprob=True, top_logprobs_num=3)
    with pytest.raises(ValueError, match="max_n"):
        build(tight, sampling_params={"n": 4})
    for name in REQUEST_CAPS:
        with pytest.raises(ValueError, match=name):
            ServerArgs(**{name: 0})


def test_a_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing():
    tokenizer = tiny_tokenizer()
    limit = max_prompt_chars(LIMITS.context_length, longest_token_chars(tokenizer))
    limits = dataclasses.replace(LIMITS, max_prompt_chars=limit)
    with pytest.raises(ValueError, match="characters"):
        build(limits, tokenizer, input_ids=None, text="a" * (limit + 1))
    # Below the bound the tokenizer decides (here: too many tokens for the context).
    with pytest.raises(ValueError, match="context length"):
        build(limits, tokenizer, input_ids=None, text="a " * 9000)


def test_the_prompt_bound_never_refuses_a_prompt_that_fits():
    tokenizer = tiny_tokenizer()
    longest = longest_token_chars(tokenizer)
    token = max(tokenizer.get_vocab(), key=len)
    text = tokenizer.convert_tokens_to_string([token]) * 100
    assert len(tokenizer.encode(text)) <= 100 * 2  # the bound's premise, on this vocabulary
    assert len(text) <= max_prompt_chars(200, longest)


@pytest.mark.parametrize("messages, template_kwargs", [
    ([{"role": "user"}] * 4, {}),  # no content, still counted
    ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], {}),
    ([{"role": "user", "content": "hi"}], {"documents": [{"text": "x" * 50}]}),
])
def test_a_chat_counts_every_part_of_its_messages_and_template_variables(messages,
                                                                         template_kwargs):
    counted = chat_chars(messages, template_kwargs)
    contents = sum(len(str(m.get("content") or "")) for m in messages)
    assert counted > contents and counted >= 16 * len(messages)
    assert chat_chars(messages * 3, template_kwargs) > chat_chars(messages, template_kwargs)
