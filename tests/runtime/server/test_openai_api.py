"""The OpenAI API, served by a live uvicorn server and driven by the official ``openai``
client (and raw HTTP where the client hides the wire format). Beam search over HTTP too
(its last section): the native ``/generate`` returns the Engine's beams and refuses a
conflicting field with a 400 naming it; ``/v1/completions`` takes ``use_beam_search``,
``length_penalty`` and ``early_stopping`` as extra body fields, with ``n`` the width, and
returns transformers' hypotheses best first."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from beam_reference import beam, reference_beams
from live_server import LiveServer
from workloads import PROMPTS, greedy, random_ids

from radixlm.runtime.server.http_server import create_app

MODEL = "tiny"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture
def live(engine_for, monkeypatch):
    """(server url, engine); the engine's tokenizer gets a chat template for the test."""
    engine = engine_for()
    monkeypatch.setattr(engine.tokenizer, "chat_template", CHAT_TEMPLATE, raising=False)
    server = LiveServer(create_app(engine, served_model_name=MODEL))
    yield server.url, engine
    server.close()


@pytest.fixture
def client(live):
    with openai.OpenAI(base_url=live[0] + "/v1", api_key="x", max_retries=0) as client:
        yield client


@pytest.fixture
def model(client):
    return client.models.list().data[0].id


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert len(models) == 1 and models[0].object == "model" and models[0].owned_by == "radixlm"


def test_greedy_completion_matches_the_native_generate(client, model, live):
    native = httpx.post(live[0] + "/generate", timeout=30,
                        json={"text": PROMPTS[1], "sampling_params": greedy(8)})
    expected = native.json()
    out = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=8, **GREEDY)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.choices[0].text == expected["text"]
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8
    assert out.usage.prompt_tokens == expected["meta_info"]["prompt_tokens"]
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8


def test_token_id_prompts_batches_n_and_echo(client, model, live):
    engine = live[1]
    ids = engine.tokenizer.encode(PROMPTS[0])
    expected = [engine.generate(p, greedy(4))["text"] for p in PROMPTS[:2]]
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=4, **GREEDY)
    assert by_ids.choices[0].text == expected[0]
    batch = client.completions.create(model=model, prompt=PROMPTS[:2], max_tokens=4, n=2,
                                      echo=True, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [
        PROMPTS[0] + expected[0], PROMPTS[0] + expected[0],
        PROMPTS[1] + expected[1], PROMPTS[1] + expected[1],
    ]
    assert batch.usage.completion_tokens == 16


def test_completion_logprobs_have_top_k_and_offsets(client, model):
    out = client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=5, logprobs=3,
                                    **GREEDY)
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert "".join(logprobs.tokens) == out.choices[0].text
    assert all(len(top) <= 3 and max(top.values()) >= lp - 1e-4
               for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs))
    assert logprobs.text_offset[0] == 0
    assert logprobs.text_offset[1] == len(logprobs.tokens[0])
    echoed = client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=2,
                                       logprobs=1, echo=True, **GREEDY).choices[0].logprobs
    assert echoed.token_logprobs[0] is None and len(echoed.tokens) > 2
    streamed = list(client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=5,
                                              logprobs=3, stream=True, **GREEDY))
    assert sum((c.choices[0].logprobs.tokens for c in streamed), []) == logprobs.tokens
    assert sum((c.choices[0].logprobs.text_offset for c in streamed), []) == logprobs.text_offset


def test_stop_string_ends_the_completion(client, model, live):
    full = live[1].generate(PROMPTS[3], greedy(12))["text"]
    stop = full[3:5]
    assert stop.strip(), "the tiny model's output needs a visible stop string"
    out = client.completions.create(model=model, prompt=PROMPTS[3], max_tokens=12, stop=stop,
                                    **GREEDY)
    assert out.choices[0].finish_reason == "stop"
    assert full.startswith(out.choices[0].text) and stop not in out.choices[0].text
    streamed = client.completions.create(model=model, prompt=PROMPTS[3], max_tokens=12,
                                         stop=stop, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text


def test_seed_makes_sampling_reproducible(client, model):
    def sample(seed: int) -> str:
        return client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=12,
                                         temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text
    assert sample(7) == sample(7)
    assert len({sample(7), sample(8), sample(9)}) > 1


def test_streamed_completion_deltas_add_up_to_the_text_then_usage(client, model):
    kwargs = {"model": model, "prompt": PROMPTS[:2], "max_tokens": 10, "n": 2, **GREEDY}
    whole = client.completions.create(**kwargs)
    texts = ["", "", "", ""]
    finish = [None] * 4
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert texts == [c.text for c in whole.choices]
    assert finish == ["length"] * 4
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40


def test_chat_completion_and_cached_prompt_tokens(client, model, live):
    live[1].flush_cache()
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": PROMPTS[1]}]}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                           logprobs=True, top_logprobs=2, **GREEDY)
    assert first.object == "chat.completion" and first.id.startswith("chatcmpl-")
    choice = first.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert len(choice.logprobs.content) == 6
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert "".join(t.token for t in choice.logprobs.content) == choice.message.content
    again = client.chat.completions.create(model=model, messages=messages,
                                           max_completion_tokens=6, **GREEDY)
    assert again.choices[0].message.content == choice.message.content
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_streamed_chat_sends_the_role_then_content(client, model):
    messages = [{"role": "user", "content": PROMPTS[0]}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                           **GREEDY)
    chunks = list(client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


@pytest.mark.parametrize("kwargs", [
    {"temperature": -1},
    {"top_p": 0},
    {"logprobs": 99},
    {"extra_body": {"regex": "foo**"}},
])
def test_bad_completion_input_is_a_bad_request(client, model, kwargs):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="hi", max_tokens=2, **kwargs)


@pytest.mark.parametrize("kwargs", [
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
    {"response_format": {"type": "json_object"}, "extra_body": {"regex": "a+"}},
    {"top_logprobs": 2},
])
def test_unsupported_chat_options_are_a_bad_request(client, model, kwargs):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, max_tokens=2,
                                       messages=[{"role": "user", "content": "x"}], **kwargs)


def test_errors_use_the_openai_body(live):
    with httpx.Client(base_url=live[0], timeout=30) as http:
        unknown = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                     "surprise": 1})
        assert unknown.status_code == 400
        error = unknown.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"] == "surprise" and error["type"] == "invalid_request_error"
        bad_json = http.post("/v1/chat/completions", content=b"{nope",
                             headers={"content-type": "application/json"})
        assert bad_json.status_code == 400 and "error" in bad_json.json()
        missing = http.post("/v1/completions", json={"model": "other", "prompt": "hi"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert "/v1/chat/completions" in http.get("/openapi.json").json()["paths"]


def test_chat_without_a_template_is_a_bad_request(client, model, live, monkeypatch):
    monkeypatch.setattr(live[1].tokenizer, "chat_template", None)
    with pytest.raises(openai.BadRequestError, match="chat template"):
        client.chat.completions.create(model=model, max_tokens=2,
                                       messages=[{"role": "user", "content": "x"}])


def test_a_stream_closed_early_frees_its_request(client, model, live):
    stream = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=500,
                                       stream=True, **GREEDY)
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 10
    while live[1].get_server_info()["num_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live[1].get_server_info()["num_running"] == 0


# Beam search ------------------------------------------------------------------------------


def test_native_generate_returns_the_engine_s_beams_best_first(live):
    url, engine = live
    ids = random_ids(1100, 12)
    params = beam(3, 8, 0.0, "never")
    expected = engine.generate(input_ids=ids, sampling_params=params)
    response = httpx.post(url + "/generate", timeout=60,
                          json={"input_ids": ids, "sampling_params": params})
    assert response.status_code == 200
    outs = response.json()
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in expected]
    assert [o["text"] for o in outs] == [o["text"] for o in expected]
    assert [o["meta_info"]["beam_score"] for o in outs] == pytest.approx(
        [o["meta_info"]["beam_score"] for o in expected], abs=1e-4)
    scores = [o["meta_info"]["beam_score"] for o in outs]
    assert scores == sorted(scores, reverse=True)


@pytest.mark.parametrize(("extra", "field"), [
    ({"temperature": 0.8}, "temperature"),
    ({"stop": ["x"]}, "stop"),
    ({"use_beam_search": False, "length_penalty": 2.0}, "length_penalty"),
])
def test_a_conflicting_field_is_a_400_naming_it_and_the_server_keeps_serving(
    live, extra, field
):
    url, _ = live
    body = {"input_ids": [5, 6, 7], "sampling_params": {**beam(2, 4), **extra}}
    response = httpx.post(url + "/generate", json=body, timeout=60)
    assert response.status_code == 400
    assert field in response.json()["error"]["message"]
    ok = httpx.post(url + "/generate", timeout=60,
                    json={"input_ids": [5, 6, 7], "sampling_params": greedy(2)})
    assert ok.status_code == 200


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.0}], ids=["default", "greedy"])
def test_openai_completions_take_beam_search_as_extra_body_fields(
    client, live, tiny_model_dir, sampling
):
    """n=2 choices, best first: transformers' two hypotheses as text, equal to the Engine's.
    A temperature of 0 is what beam search does anyway, so it is accepted."""
    engine = live[1]
    ids = random_ids(1200, 12)
    out = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=8, n=2, **sampling,
        extra_body={"use_beam_search": True, "length_penalty": 1.0, "early_stopping": False})
    native = engine.generate(input_ids=ids, sampling_params=beam(2, 8))
    eos = [engine.tokenizer.eos_token_id]
    expected = reference_beams(tiny_model_dir(), ids, 2, 8, 1.0, False, eos)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [o["text"] for o in native]
    assert [c.text for c in out.choices] == [
        engine.tokenizer.decode(tokens, skip_special_tokens=True) for tokens, _ in expected]
    assert [c.finish_reason for c in out.choices] == [
        "stop" if tokens[-1] in eos else "length" for tokens, _ in expected]
    assert out.usage.completion_tokens == sum(len(tokens) for tokens, _ in expected)


def test_openai_completions_refuse_a_sampled_beam_search_naming_temperature(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, n=2,
                                  temperature=0.8, extra_body={"use_beam_search": True})
