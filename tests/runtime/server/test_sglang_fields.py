"""SGLang's request fields: the bodies SGLang's router and clients send are served, fields
radixlm lacks are accepted at their neutral values and refused by name otherwise, and
unknown fields are still refused. Also the worker routes the router reads."""

from __future__ import annotations

import httpx
import pytest
from live_server import LiveServer

from radixlm.runtime.server.http_server import create_app
from radixlm.runtime.server.sglang_fields import NATIVE_FIELDS

pytestmark = pytest.mark.slow  # servers of their own: CI's last stage

MODEL = "tiny"
CHAT_TEMPLATE = (
    "{% if greeting %}{{ greeting }}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
# What SGLang's router (smg 0.3.2) adds to a minimal body, as it sends it to a worker.
ROUTER_GENERATE_DEFAULTS = {"model": None, "return_text_in_logprobs": False, "stream": False,
                            "log_metrics": True, "return_hidden_states": False,
                            "background": False, "no_logs": False, "return_bytes": False,
                            "return_entropy": False}
ROUTER_COMPLETION_DEFAULTS = {"stream": False, "echo": False, "no_stop_trim": False,
                              "ignore_eos": False, "skip_special_tokens": True,
                              "return_hidden_states": False}
ROUTER_CHAT_DEFAULTS = {"logprobs": False, "stream": False, "no_stop_trim": False,
                        "ignore_eos": False, "continue_final_message": False,
                        "skip_special_tokens": True, "separate_reasoning": True,
                        "stream_reasoning": True, "return_hidden_states": False}


@pytest.fixture(scope="module")
def url(tiny_model_dir):
    import radixlm

    with radixlm.Engine(str(tiny_model_dir()), dtype="float32", max_total_tokens=4096) as engine:
        engine.tokenizer.chat_template = CHAT_TEMPLATE
        server = LiveServer(create_app(engine, served_model_name=MODEL))
        try:
            yield server.url
        finally:
            server.close()


def post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{route}", json=body, timeout=60)


def test_the_routers_generate_body_is_served_as_the_plain_one(url):
    plain = {"text": "The quick brown fox", "sampling_params": GREEDY}
    want = post(url, "/generate", plain)
    got = post(url, "/generate", {**plain, **ROUTER_GENERATE_DEFAULTS})
    assert want.status_code == got.status_code == 200, got.text
    assert got.json()["output_ids"] == want.json()["output_ids"]


@pytest.mark.parametrize(("field", "value"), [
    ("priority", 7), ("custom_labels", {"team": "a"}), ("log_metrics", False),
    ("routing_key", "k"), ("model", "any-name"), ("data_parallel_rank", 0),
    ("lora_path", None), ("image_data", None), ("return_hidden_states", False),
])
def test_ignored_and_neutral_fields_are_accepted(url, field, value):
    reply = post(url, "/generate", {"text": "Hi", "sampling_params": GREEDY, field: value})
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize(("field", "value"), [
    ("return_hidden_states", True), ("lora_path", "adapter"), ("session_id", "s1"),
    ("image_data", "http://example.com/cat.png"), ("bootstrap_room", 5),
    ("return_entropy", True), ("background", True), ("data_parallel_rank", 1),
    ("input_embeds", [[0.1, 0.2]]), ("custom_logit_processor", "code"),
])
def test_a_field_asking_for_what_radixlm_lacks_is_a_400_naming_it(url, field, value):
    reply = post(url, "/generate", {"text": "Hi", field: value})
    assert reply.status_code == 400
    assert field in reply.json()["error"]["message"]


def test_unknown_fields_and_mistyped_sglang_fields_are_still_refused(url):
    unknown = post(url, "/generate", {"text": "Hi", "not_a_field": 1})
    assert unknown.status_code == 400 and "not_a_field" in unknown.text
    mistyped = post(url, "/generate", {"text": "Hi", "log_metrics": "often"})
    assert mistyped.status_code == 400 and "log_metrics" in mistyped.text
    assert set(NATIVE_FIELDS).isdisjoint({"text", "input_ids", "sampling_params", "rid"})


def test_sglang_sampling_parameters(url):
    ok = post(url, "/generate", {"text": "Hi", "sampling_params": {**GREEDY,
                                                                   "stream_interval": 4}})
    assert ok.status_code == 200, ok.text
    beam = post(url, "/generate", {"text": "Hi", "sampling_params": {"beam_width": 4}})
    assert beam.status_code == 400 and "sampling_params.beam_width" in beam.text
    listed = post(url, "/generate", {"text": ["a", "b"], "sampling_params": [
        {}, {"custom_params": {"a": 1}}]})
    assert listed.status_code == 400 and "sampling_params[1].custom_params" in listed.text


def test_the_routers_openai_bodies_are_served(url):
    completion = post(url, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4,
                                               **ROUTER_COMPLETION_DEFAULTS})
    assert completion.status_code == 200, completion.text
    chat = post(url, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
        "max_completion_tokens": 4, **ROUTER_CHAT_DEFAULTS})
    assert chat.status_code == 200, chat.text
    for route, field, value in [("/v1/completions", "suffix", "end"),
                                ("/v1/completions", "best_of", 3),
                                ("/v1/chat/completions", "continue_final_message", True),
                                ("/v1/chat/completions", "reasoning_effort", "high")]:
        body = {"model": MODEL, field: value}
        body.update({"prompt": "Hi"} if "chat" not in route else
                    {"messages": [{"role": "user", "content": "Hi"}]})
        refused = post(url, route, body)
        assert refused.status_code == 400 and field in refused.text, (route, field)
    unknown = post(url, "/v1/completions", {"model": MODEL, "prompt": "Hi", "nonsense": 1})
    assert unknown.status_code == 400 and "nonsense" in unknown.text


def test_openai_routes_take_sglangs_sampling_and_request_extras(url):
    base = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 12,
            "temperature": 0, "ignore_eos": True}
    free = post(url, "/v1/completions", base).json()["choices"][0]["text"]
    assert len(free) > 3
    stop = free[2:4]
    cut = post(url, "/v1/completions", {**base, "stop_regex": [stop.replace(".", "\\.")]})
    assert cut.json()["choices"][0]["text"] == free[:free.index(stop)]
    kept = post(url, "/v1/completions", {**base, "stop": [stop], "no_stop_trim": True})
    assert kept.json()["choices"][0]["text"] == free[:free.index(stop) + len(stop)]
    schema = post(url, "/v1/completions", {**base, "response_format": {
        "type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {
            "a": {"type": "integer"}}, "required": ["a"]}}}})
    assert schema.status_code == 200 and schema.json()["choices"][0]["text"].startswith("{")
    named = post(url, "/v1/completions", {**base, "rid": "openai-rid-1"})
    assert named.status_code == 200


def test_chat_template_kwargs_reach_the_template(url):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    plain = post(url, "/v1/chat/completions", body).json()["usage"]["prompt_tokens"]
    greeted = post(url, "/v1/chat/completions", {
        **body, "chat_template_kwargs": {"greeting": "Hello there, friend"}}).json()
    assert greeted["usage"]["prompt_tokens"] > plain
    reserved = post(url, "/v1/chat/completions", {**body,
                                                  "chat_template_kwargs": {"tokenize": True}})
    assert reserved.status_code == 400 and "chat_template_kwargs" in reserved.text


def test_the_worker_routes_the_router_reads(url):
    info = httpx.get(f"{url}/server_info").json()
    assert (info["tp_size"], info["dp_size"]) == (1, 1)
    assert info["disaggregation_mode"] == "null" and info["load_balance_method"]
    assert httpx.get(f"{url}/model_info").json()["model_type"] == "llama"
    [load] = httpx.get(f"{url}/get_load").json()
    assert load == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
