"""LoRA adapters with prefill/decode disaggregation (issue 61): requests on three adapters and
the base model, paired on a prefill and a decode server as SGLang's router pairs them, give
transformers + peft's greedy tokens and logprobs; with two adapter slots a side, the
decode side takes a handed-off request on a third adapter only once a slot frees, and
every request still finishes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from live_server import free_port
from lora_adapters import ALL, assert_matches_reference, random_prompts, write_peft_adapter
from pd_pairs import paired
from runtime_checks import assert_engine_idle

NEW_TOKENS = 8
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
ADAPTERS = {"all4": dict(r=4, lora_alpha=8, target_modules=ALL),
            "qv2": dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
            "od3": dict(r=3, lora_alpha=3, target_modules=["o_proj", "down_proj"])}
PORT = free_port()


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("pd-lora")
    return {name: write_peft_adapter(tiny_model_dir(), root / name, seed=70 + i, **config)
            for i, (name, config) in enumerate(ADAPTERS.items())}


@pytest.mark.slow  # (two servers; LoRA and PD each run in the default stage)
def test_paired_requests_on_adapters_decode_as_peft_does(engine_for, tiny_model_dir,
                                                         adapters):
    lora = dict(lora_paths=tuple(f"{n}={p}" for n, p in adapters.items()),
                max_loras_per_batch=2)
    prefill = engine_for(disaggregation_mode="prefill", disaggregation_bootstrap_port=PORT,
                         **lora)
    decode = engine_for(disaggregation_mode="decode", **lora)
    prompts = random_prompts(12, seed=11)
    names = [[*ADAPTERS, None][i % 4] for i in range(len(prompts))]
    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(
            lambda job: paired(prefill, decode, PORT, input_ids=job[0], lora_path=job[1],
                               sampling_params=GREEDY, return_logprob=True),
            zip(prompts, names)))
    for result in results:
        for half in result:
            assert not isinstance(half, BaseException), half
    assert_matches_reference(tiny_model_dir(), adapters, prompts, names,
                             [decoded for _, decoded in results], NEW_TOKENS)
    assert_engine_idle(prefill)
    assert_engine_idle(decode)
