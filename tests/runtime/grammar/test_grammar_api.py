"""Constraints through the public APIs on the tiny model: the Engine (n > 1, streaming,
the jump-forward count and its switch), the native HTTP API and the OpenAI API through the
official client (``response_format``, the ``regex`` / ``ebnf`` extras); bad constraints are
refused by name (``ValueError`` / 400) and the runtime keeps serving."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from live_server import LiveServer

from radixlm.runtime.server.http_server import create_app

REGEX = r"[A-Z][a-z]{1,6} (is|was) [0-9]{1,2} years old\."
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10},
                   "population": {"type": "integer", "minimum": 0, "maximum": 10**6}},
    "required": ["city", "population"],
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
BAD_CONSTRAINTS = [
    ({"regex": "foo**"}, "regex"),
    ({"json_schema": '{"type": "nonsense"}'}, "json_schema"),
    ({"json_schema": "{not json"}, "json_schema"),
    ({"ebnf": "root ::= undefined"}, "ebnf"),
    ({"regex": "a+", "ebnf": 'root ::= "a"'}, "at most one"),
]


def sampled(**params) -> dict:
    return {"temperature": 0.7, "max_new_tokens": 120, **params}


@pytest.mark.parametrize(("params", "problem"), BAD_CONSTRAINTS,
                         ids=[p for _, p in BAD_CONSTRAINTS])
def test_the_engine_refuses_a_bad_constraint_naming_it_and_keeps_serving(
    engine_for, params, problem
):
    engine = engine_for()
    with pytest.raises(ValueError, match=problem):
        engine.generate("hi", sampled(**params))
    out = engine.generate("hi", sampled(regex="ok|no"))
    assert out["text"] in ("ok", "no")


def test_n_samples_each_follow_the_grammar_with_their_own_matcher(engine_for):
    engine = engine_for()
    outs = engine.generate("The quick brown fox", sampled(n=4, regex=REGEX, sampling_seed=3))
    assert len(outs) == 4
    for out in outs:
        assert re.fullmatch(REGEX, out["text"]), out["text"]
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert len({out["text"] for out in outs}) > 1, "seeded samples differ"


def test_a_streamed_json_output_validates_and_equals_the_unstreamed_one(engine_for):
    engine = engine_for()
    params = sampled(json_schema=json.dumps(SCHEMA), temperature=0.0)
    chunks = list(engine.generate("Paris is", params, stream=True))
    whole = engine.generate("Paris is", params)
    assert chunks[-1]["text"] == whole["text"]
    jsonschema.validate(json.loads(whole["text"]), SCHEMA)


def test_meta_info_counts_jumped_tokens_and_the_switch_turns_them_off(engine_for):
    params = sampled(json_schema=json.dumps(SCHEMA), temperature=0.0)
    on = engine_for().generate("Berlin is", params)
    off = engine_for(disable_jump_forward=True).generate("Berlin is", params)
    assert on["meta_info"]["jump_forward_tokens"] > 0
    assert off["meta_info"]["jump_forward_tokens"] == 0
    assert on["text"] == off["text"]
    unconstrained = engine_for().generate("Berlin is", {"max_new_tokens": 4})
    assert unconstrained["meta_info"]["jump_forward_tokens"] == 0


def test_requests_wanting_logprobs_get_one_per_token_and_no_jumps(engine_for):
    out = engine_for().generate("Rome is", sampled(json_schema=json.dumps(SCHEMA)),
                                return_logprob=True)
    meta = out["meta_info"]
    assert meta["jump_forward_tokens"] == 0
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    jsonschema.validate(json.loads(out["text"]), SCHEMA)


# HTTP -------------------------------------------------------------------------------------


@pytest.fixture
def live(engine_for, monkeypatch):
    engine = engine_for()
    monkeypatch.setattr(engine.tokenizer, "chat_template", CHAT_TEMPLATE, raising=False)
    server = LiveServer(create_app(engine, served_model_name="tiny"))
    yield server.url
    server.close()


@pytest.fixture
def client(live):
    with openai.OpenAI(base_url=live + "/v1", api_key="x", max_retries=0) as client:
        yield client


def test_native_generate_with_a_regex_and_bad_constraints_as_400s(live):
    with httpx.Client(base_url=live, timeout=60) as http:
        out = http.post("/generate", json={"text": "hi", "sampling_params": sampled(regex=REGEX)})
        assert out.status_code == 200 and re.fullmatch(REGEX, out.json()["text"])
        for params, problem in BAD_CONSTRAINTS:
            bad = http.post("/generate", json={"text": "hi", "sampling_params": sampled(**params)})
            assert bad.status_code == 400 and problem in bad.json()["error"]["message"]
        assert http.get("/health").status_code == 200
        again = http.post("/generate", json={"text": "hi",
                                             "sampling_params": sampled(ebnf='root ::= "ok"')})
        assert again.status_code == 200 and again.json()["text"] == "ok"


def test_openai_chat_response_format_json_schema_and_json_object(client):
    messages = [{"role": "user", "content": "Describe a city."}]
    out = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=120, temperature=0.7,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": SCHEMA}},
    )
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    anything = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=200, temperature=0.0,
        response_format={"type": "json_object"},
    )
    choice = anything.choices[0]
    assert choice.finish_reason in ("stop", "length")
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.message.content.startswith("{")


def test_openai_regex_and_ebnf_extras(client):
    completion = client.completions.create(model="tiny", prompt="Age:", max_tokens=60,
                                           extra_body={"regex": REGEX})
    assert re.fullmatch(REGEX, completion.choices[0].text)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "yes or no?"}], max_tokens=10,
        extra_body={"ebnf": 'root ::= "yes" | "no"'},
    )
    assert chat.choices[0].message.content in ("yes", "no")


@pytest.mark.parametrize("kwargs", [
    {"extra_body": {"regex": "foo**"}},
    {"extra_body": {"json_schema": '{"type": 5}'}},
    {"response_format": {"type": "json_object"}, "extra_body": {"regex": "a+"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
])
def test_openai_bad_constraints_are_bad_requests_and_the_server_keeps_serving(client, kwargs):
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, **kwargs)
    ok = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")
