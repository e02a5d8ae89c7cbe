"""LoRA adapters through a live server (radixlm/runtime/server/lora_routes.py and the LoRA
parts of openai_api.py): SGLang's /load_lora_adapter and /unload_lora_adapter, /v1/models
listing adapters, OpenAI completions and chat naming an adapter as ``<served>:<adapter>`` or
``<adapter>`` (the official ``openai`` client), the native /generate's ``lora_path``; each
output equal to the Engine's for the same adapter; bad adapters and names refused with a
status naming them while the server serves on."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from lora_adapters import random_prompts, write_raw_adapter

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("routes")
    return {"r1": write_raw_adapter(root / "r1", seed=41, rank=2),
            "r2": write_raw_adapter(root / "r2", seed=42, rank=1,
                                    targets=("o_proj", "down_proj")),
            "spare": write_raw_adapter(root / "spare", seed=43, rank=2,
                                       targets=("q_proj", "k_proj", "v_proj"))}


OPTIONS = {"max_loras_per_batch": 2, "max_lora_rank": 4}


@pytest.fixture
def server(live, engine_for, raw, monkeypatch):
    """(url, engine, served model name): r1 and r2 loaded from start-up."""
    options = {"lora_paths": (f"r1={raw['r1']}", f"r2={raw['r2']}"), **OPTIONS}
    engine = engine_for(**options)
    monkeypatch.setattr(engine.tokenizer, "chat_template", CHAT_TEMPLATE, raising=False)
    url = live(**options)
    served = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    yield url, engine, served
    for name in set(engine.lora_adapters()) - {"r1", "r2"}:
        engine.unload_lora_adapter(name)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def model_ids(url: str) -> list[str]:
    return [card["id"] for card in httpx.get(url + "/v1/models").json()["data"]]


def test_models_lists_the_adapters_under_the_model(server):
    url, _, served = server
    cards = httpx.get(url + "/v1/models").json()["data"]
    assert [card["id"] for card in cards] == [served, "r1", "r2"]
    assert [card["parent"] for card in cards] == [None, served, served]


def test_load_and_unload_answer_as_sglang(server, raw):
    url, engine, _ = server
    loaded = post(url, "/load_lora_adapter", {"lora_name": "spare",
                                              "lora_path": str(raw["spare"]),
                                              "pinned": False})
    assert loaded.status_code == 200, loaded.text
    body = loaded.json()
    assert body["success"] is True and body["error_message"] == ""
    assert body["loaded_adapters"] == ["r1", "r2", "spare"]
    assert "spare" in model_ids(url) and engine.lora_adapters() == ["r1", "r2", "spare"]
    out = post(url, "/generate", {"text": PROMPT, "sampling_params": GREEDY,
                                  "lora_path": "spare"})
    assert out.status_code == 200
    assert out.json()["output_ids"] == engine.generate(PROMPT, GREEDY,
                                                       lora_path="spare")["output_ids"]
    unloaded = post(url, "/unload_lora_adapter", {"lora_name": "spare"})
    assert unloaded.status_code == 200, unloaded.text
    body = unloaded.json()
    assert body["success"] is True and body["loaded_adapters"] == ["r1", "r2"]
    assert "spare" not in model_ids(url)
    again = post(url, "/unload_lora_adapter", {"lora_name": "spare"})
    assert again.status_code == 400
    assert again.json()["success"] is False and "'spare'" in again.json()["error_message"]
    refused = post(url, "/generate", {"text": PROMPT, "sampling_params": GREEDY,
                                      "lora_path": "spare"})
    assert refused.status_code == 400 and "spare" in refused.text


def broken_copy(source: Path, target: Path, change) -> Path:
    target.mkdir()
    for item in source.iterdir():
        (target / item.name).write_bytes(item.read_bytes())
    change(target)
    return target


def test_bad_adapters_are_400s_naming_what_is_wrong_and_the_server_serves_on(
        server, raw, tmp_path):
    url, engine, _ = server
    weights = "adapter_model.safetensors"
    config = "adapter_config.json"

    def set_config(**fields):
        def change(d: Path) -> None:
            found = json.loads((d / config).read_text())
            (d / config).write_text(json.dumps({**found, **fields}))
        return change

    cases = {
        "truncated": (lambda d: (d / weights).write_bytes((d / weights).read_bytes()[:64]),
                      "unreadable"),
        "no-config": (lambda d: (d / config).unlink(), "no adapter_config.json"),
        "pickled": (lambda d: (d / weights).rename(d / "adapter_model.bin"),
                    "adapter_model.bin is a pickle"),
        "dora": (set_config(use_dora=True), "DoRA"),
        "saved": (set_config(modules_to_save=["lm_head"]), "modules_to_save"),
        "bias": (set_config(bias="lora_only"), "bias"),
    }
    for name, (change, words) in cases.items():
        path = broken_copy(raw["r1"], tmp_path / name, change)
        reply = post(url, "/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        assert reply.status_code == 400, (name, reply.text)
        assert reply.json()["success"] is False and words in reply.json()["error_message"]
    high = write_raw_adapter(tmp_path / "high", seed=1, rank=OPTIONS["max_lora_rank"] + 1)
    reply = post(url, "/load_lora_adapter", {"lora_name": "high", "lora_path": str(high)})
    assert reply.status_code == 400 and "above --max-lora-rank 4" in reply.text
    taken = post(url, "/load_lora_adapter", {"lora_name": "r1", "lora_path": str(raw["r2"])})
    assert taken.status_code == 400 and "loaded already" in taken.text
    assert post(url, "/load_lora_adapter", {"lora_name": "x"}).status_code in (400, 422)
    assert model_ids(url)[1:] == ["r1", "r2"]
    out = post(url, "/generate", {"text": PROMPT, "sampling_params": GREEDY,
                                  "lora_path": "r2"})
    assert out.json()["output_ids"] == engine.generate(PROMPT, GREEDY,
                                                       lora_path="r2")["output_ids"]


def test_native_generate_takes_one_adapter_or_one_per_prompt(server):
    url, engine, _ = server
    prompts = random_prompts(3, seed=44)
    for lora_path in ("r1", ["r2", None, "r1"]):
        body = {"input_ids": prompts, "sampling_params": GREEDY, "lora_path": lora_path}
        reply = post(url, "/generate", body)
        assert reply.status_code == 200, reply.text
        want = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=lora_path)
        assert [o["output_ids"] for o in reply.json()] == [o["output_ids"] for o in want]
    base = engine.generate(input_ids=prompts[1], sampling_params=GREEDY)
    assert reply.json()[1]["output_ids"] == base["output_ids"]
    for bad in ("nope", ["r1", "nope", None], ["r1"]):
        refused = post(url, "/generate", {"input_ids": prompts, "sampling_params": GREEDY,
                                          "lora_path": bad})
        assert refused.status_code == 400, refused.text


def test_openai_completions_and_chat_name_the_adapter_in_the_model(server):
    url, engine, served = server
    want = engine.generate(PROMPT, GREEDY, lora_path="r1")
    base = engine.generate(PROMPT, GREEDY)
    assert want["text"] != base["text"]
    with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:
        extra = {"temperature": 0.0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}
        for model in (f"{served}:r1", "r1"):
            out = client.completions.create(model=model, prompt=PROMPT, **extra)
            assert out.choices[0].text == want["text"], model
        out = client.completions.create(model=served, prompt=PROMPT, **extra)
        assert out.choices[0].text == base["text"]
        messages = [{"role": "user", "content": "Name a capital."}]
        chats = {model: client.chat.completions.create(model=model, messages=messages,
                                                       **extra).choices[0].message.content
                 for model in (f"{served}:r2", "r2", served)}
        text = engine.tokenizer.apply_chat_template(messages, tokenize=False,
                                                    add_generation_prompt=True)
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        chat_want = engine.generate(input_ids=ids, sampling_params=GREEDY, lora_path="r2")
        assert chats[f"{served}:r2"] == chats["r2"] == chat_want["text"]
        assert chats[served] != chats["r2"]
        for model in (f"{served}:nope", "nope"):
            with pytest.raises(openai.NotFoundError, match="nope"):
                client.completions.create(model=model, prompt=PROMPT, **extra)
        with pytest.raises(openai.BadRequestError, match="nope"):
            client.completions.create(model=served, prompt=PROMPT, max_tokens=4,
                                      extra_body={"lora_path": "nope"})


def test_unloading_an_adapter_a_streaming_request_uses(server, raw):
    url, engine, _ = server
    post(url, "/load_lora_adapter", {"lora_name": "spare", "lora_path": str(raw["spare"])})
    long = {**GREEDY, "max_new_tokens": 256}  # (still running when the unload comes)
    want = engine.generate(PROMPT, long, lora_path="spare")
    body = {"text": PROMPT, "sampling_params": long, "lora_path": "spare", "stream": True}
    events = []
    with httpx.stream("POST", url + "/generate", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                break
        unloaded = post(url, "/unload_lora_adapter", {"lora_name": "spare"})
        assert unloaded.status_code == 200 and unloaded.json()["in_use"] is True
        assert "spare" not in model_ids(url)
        refused = post(url, "/generate", {"text": PROMPT, "sampling_params": GREEDY,
                                          "lora_path": "spare"})
        assert refused.status_code == 400
        events += [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["output_ids"] == want["output_ids"]
    loaded = post(url, "/load_lora_adapter", {"lora_name": "spare",
                                              "lora_path": str(raw["spare"])})
    assert loaded.status_code == 200, loaded.text
    out = post(url, "/generate", {"text": PROMPT, "sampling_params": long,
                                  "lora_path": "spare"})
    assert out.json()["output_ids"] == want["output_ids"]


def test_the_responses_api_takes_the_adapters_v1_models_lists(server):
    url, engine, served = server
    reply = post(url, "/v1/responses", {"model": "r1", "input": PROMPT,
                                        "max_output_tokens": 8, "temperature": 0})
    assert reply.status_code == 200, reply.text


def test_openai_answers_name_the_adapter_the_request_named(server):
    url, _, served = server
    with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:
        for model in (f"{served}:r1", "r1"):
            out = client.completions.create(model=model, prompt=PROMPT, max_tokens=2)
            assert out.model == model


@pytest.mark.slow
def test_a_server_without_lora_refuses_adapters_with_400s(live, raw):
    url = live()
    reply = post(url, "/load_lora_adapter", {"lora_name": "r1", "lora_path": str(raw["r1"])})
    assert reply.status_code == 400 and "--enable-lora" in reply.json()["error_message"]
    assert len(model_ids(url)) == 1
    refused = post(url, "/generate", {"text": PROMPT, "sampling_params": GREEDY,
                                      "lora_path": "r1"})
    assert refused.status_code == 400 and "LoRA" in refused.text


def test_the_served_model_s_name_keeps_meaning_the_base_model(server, raw):
    url, engine, served = server
    base = engine.generate(PROMPT, GREEDY)
    post(url, "/load_lora_adapter", {"lora_name": served, "lora_path": str(raw["spare"])})
    with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:
        out = client.completions.create(model=served, prompt=PROMPT, max_tokens=8,
                                        temperature=0.0, extra_body={"ignore_eos": True})
    assert out.choices[0].text == base["text"]
