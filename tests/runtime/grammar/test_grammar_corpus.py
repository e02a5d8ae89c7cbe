"""The default model (SmolLM2-135M-Instruct) under the constraint corpus: at temperature 0.7
every output of 50 JSON schemas and 20 regexes validates (jsonschema with format checks,
``re.fullmatch``) and ends by its grammar, not its budget; jump-forward removes a third of
the decode steps on fixed-key JSON and, at temperature 0, mostly keeps the text."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from grammar_corpus import (
    JSON_SCHEMAS,
    MAX_NEW_TOKENS,
    REGEXES,
    json_prompt,
    regex_prompt,
)
from runtime_checks import assert_engine_idle

import radixlm

pytestmark = pytest.mark.default_model

OPTIONS = {"dtype": "float32", "max_total_tokens": 65536, "max_running_requests": 80}


@pytest.fixture(scope="module")
def engine():
    with radixlm.Engine(**OPTIONS) as engine:
        yield engine


def chat(engine, request: str) -> str:
    return engine.apply_chat_template([{"role": "user", "content": request}])


def validate_json(text: str, schema: dict) -> None:
    validator = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    validator.validate(json.loads(text))


@pytest.mark.slow  # every corpus grammar, sampled: CI's last stage
def test_every_corpus_output_validates_at_temperature_0_7(engine):
    prompts = [chat(engine, json_prompt(what)) for what, _ in JSON_SCHEMAS]
    prompts += [chat(engine, regex_prompt(what)) for what, _ in REGEXES]
    params = [{"json_schema": json.dumps(schema)} for _, schema in JSON_SCHEMAS]
    params += [{"regex": regex} for _, regex in REGEXES]
    params = [{"temperature": 0.7, "max_new_tokens": MAX_NEW_TOKENS, "sampling_seed": index,
               **p} for index, p in enumerate(params)]
    outs = engine.generate(prompts, params)
    for out, (what, schema) in zip(outs, JSON_SCHEMAS):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", (what, out["text"])
        validate_json(out["text"], schema)
    for out, (what, regex) in zip(outs[len(JSON_SCHEMAS):], REGEXES):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", (what, out["text"])
        assert re.fullmatch(regex, out["text"]), (what, out["text"])
    assert sum(out["meta_info"]["jump_forward_tokens"] for out in outs) > 0
    assert_engine_idle(engine)


FIXED_KEY_SCHEMAS = [(what, schema) for what, schema in JSON_SCHEMAS
                     if schema.get("type") == "object"][:16]


def decode_steps(engine) -> int:
    return engine.get_server_info()["stats"]["decode_steps"]


@pytest.mark.slow
def test_jump_forward_removes_a_third_of_the_decode_steps_and_mostly_keeps_greedy_text(
    engine
):
    """One request at a time, so the decode steps are the requests' own; the same requests
    on an engine without jump-forward for the reference."""
    prompts = [chat(engine, json_prompt(what)) for what, _ in FIXED_KEY_SCHEMAS]
    params = [{"json_schema": json.dumps(schema), "temperature": 0.0,
               "max_new_tokens": MAX_NEW_TOKENS} for _, schema in FIXED_KEY_SCHEMAS]

    def run(target) -> tuple[list[dict], int]:
        before = decode_steps(target)
        outs = [target.generate(p, s) for p, s in zip(prompts, params)]
        return outs, decode_steps(target) - before

    jumped, jump_steps = run(engine)
    # One request at a time: a small pool, so that two engines stay within the suite's memory.
    small = {**OPTIONS, "max_total_tokens": 4096, "max_running_requests": 4}
    with radixlm.Engine(disable_jump_forward=True, **small) as plain_engine:
        plain, plain_steps = run(plain_engine)
    for out, (_, schema) in zip(jumped, FIXED_KEY_SCHEMAS):
        validate_json(out["text"], schema)
    same = sum(a["text"] == b["text"] for a, b in zip(jumped, plain))
    print(f"jump-forward: {jump_steps} decode steps vs {plain_steps} without "
          f"({1 - jump_steps / plain_steps:.0%} fewer); greedy text equal for {same} of "
          f"{len(prompts)} prompts")
    assert jump_steps <= 0.7 * plain_steps
    assert same >= len(prompts) // 2
