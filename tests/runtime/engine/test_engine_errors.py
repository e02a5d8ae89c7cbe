"""Bad inputs to Engine.generate and Engine(): a ValueError naming what is wrong, raised before
anything is queued, and an engine that keeps serving afterwards."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from runtime_checks import assert_engine_idle
from workloads import LONG_TEXT, greedy

import radixlm

BAD_GENERATE_CALLS = [
    ("both_prompt_and_input_ids", dict(prompt="hi", input_ids=[1, 2]), "prompt and input_ids"),
    ("neither_prompt_nor_input_ids", dict(), "prompt and input_ids"),
    ("input_ids_out_of_vocab", dict(input_ids=[1, 100_000]), "input_ids"),
    ("input_ids_negative", dict(input_ids=[-1, 3]), "input_ids"),
    ("empty_prompt", dict(prompt=""), "prompt"),
    ("empty_input_ids", dict(input_ids=[]), "input_ids"),
    ("empty_prompt_list", dict(prompt=[]), "prompt"),
    ("max_new_tokens_negative", dict(prompt="hi", sampling_params={"max_new_tokens": -1}),
     "max_new_tokens"),
    ("temperature_negative", dict(prompt="hi", sampling_params={"temperature": -1}),
     "temperature"),
    ("top_p_zero", dict(prompt="hi", sampling_params={"top_p": 0}), "top_p"),
    ("top_k_zero", dict(prompt="hi", sampling_params={"top_k": 0}), "top_k"),
    ("unknown_sampling_key", dict(prompt="hi", sampling_params={"max_tokens": 3}), "max_tokens"),
    ("stop_token_id_out_of_vocab", dict(prompt="hi", sampling_params={"stop_token_ids": [10**6]}),
     "stop_token_ids"),
    ("sampling_params_list_too_short", dict(prompt=["a", "b"], sampling_params=[{}]),
     "sampling_params"),
    ("logprob_start_len_past_prompt", dict(input_ids=[5, 6, 7], return_logprob=True,
                                           logprob_start_len=3), "logprob_start_len"),
    ("logprob_start_len_negative", dict(input_ids=[5, 6, 7], return_logprob=True,
                                        logprob_start_len=-2), "logprob_start_len"),
    ("top_logprobs_num_negative", dict(prompt="hi", return_logprob=True, top_logprobs_num=-1),
     "top_logprobs_num"),
    ("top_logprobs_num_over_the_cap", dict(prompt="hi", return_logprob=True,
                                           top_logprobs_num=100_000), "max_logprobs"),
    ("n_over_the_cap", dict(prompt="hi", sampling_params={"n": 10_000}), "max_n"),
    ("too_many_prompts", dict(prompt=["a"] * 5000), "max_samples_per_request"),
    ("too_many_stop_strings", dict(prompt="hi", sampling_params={
        "stop": [f"s{i}" for i in range(10_000)]}), "max_stop_strings"),
    ("one_bad_prompt_in_a_batch", dict(prompt=["fine", "also fine"],
                                       sampling_params=[{}, {"top_k": 0}]), "top_k"),
]


@pytest.mark.parametrize(("case", "kwargs", "name"), BAD_GENERATE_CALLS,
                         ids=[c[0] for c in BAD_GENERATE_CALLS])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_input_raises_value_error_naming_it_and_the_engine_stays_usable(
    engine_for, case, kwargs, name, stream
):
    engine = engine_for()
    with pytest.raises(ValueError, match=re.escape(name)):
        engine.generate(**kwargs, stream=stream)
    assert_engine_idle(engine)
    assert engine.generate("The quick brown fox", greedy(3))["meta_info"]["completion_tokens"] == 3


@pytest.mark.parametrize("form", ["prompt", "input_ids"])
def test_prompt_longer_than_the_context_is_refused(engine_for, form):
    engine = engine_for(context_length=64)
    ids = engine.tokenizer.encode(LONG_TEXT)[:64]
    kwargs = {"prompt": engine.tokenizer.decode(ids)} if form == "prompt" else {"input_ids": ids}
    with pytest.raises(ValueError, match=f"{form} has 6[4-9] tokens.*context length is 64"):
        engine.generate(**kwargs, sampling_params=greedy(4))
    assert engine.generate(input_ids=ids[:20], sampling_params=greedy(4))["output_ids"]


def test_an_explicit_output_budget_beyond_the_context_is_refused(engine_for):
    engine = engine_for(context_length=64)
    ids = engine.tokenizer.encode(LONG_TEXT)[:60]
    with pytest.raises(ValueError, match="max_new_tokens .50. plus the prompt .60 tokens."):
        engine.generate(input_ids=ids, sampling_params=greedy(50))
    out = engine.generate(input_ids=ids, sampling_params=greedy(4))
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


def test_the_default_output_budget_is_clamped_to_the_context(engine_for):
    engine = engine_for(context_length=64)
    ids = engine.tokenizer.encode(LONG_TEXT)[:60]
    out = engine.generate(input_ids=ids, sampling_params={"ignore_eos": True})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


def test_unknown_engine_option_is_refused_by_name(tiny_model_dir):
    with pytest.raises(ValueError, match="bogus"):
        radixlm.Engine(str(tiny_model_dir()), bogus=1)


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path):
    directory = tmp_path / "model"
    shutil.copytree(tiny_model_dir(), directory)
    return directory


def test_unknown_architecture_is_refused_listing_the_supported(model_copy):
    config_file = model_copy / "config.json"
    config = json.loads(config_file.read_text())
    config["architectures"] = ["FooForCausalLM"]
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="FooForCausalLM") as error:
        radixlm.Engine(str(model_copy), dtype="float32", max_total_tokens=256)
    assert "LlamaForCausalLM" in str(error.value)
    assert "Qwen2ForCausalLM" in str(error.value)


def test_corrupt_safetensors_is_refused_naming_the_file(model_copy):
    (model_copy / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    with pytest.raises(ValueError, match="model.safetensors"):
        radixlm.Engine(str(model_copy), dtype="float32", max_total_tokens=256)


def test_truncated_safetensors_is_refused_naming_the_file(model_copy):
    weights = model_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        radixlm.Engine(str(model_copy), dtype="float32", max_total_tokens=256)


def test_missing_weights_file_is_refused(model_copy):
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="safetensors"):
        radixlm.Engine(str(model_copy), dtype="float32", max_total_tokens=256)


def test_generate_after_shutdown_raises(tiny_model_dir):
    engine = radixlm.Engine(str(tiny_model_dir()), dtype="float32", max_total_tokens=256)
    engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate("hi", greedy(2))
