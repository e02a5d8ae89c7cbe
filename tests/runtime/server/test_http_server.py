"""The native HTTP API, served by a real uvicorn server on 127.0.0.1 and driven over HTTP."""

from __future__ import annotations

import json

import httpx
import pytest
from live_server import LiveServer
from workloads import PROMPTS, greedy

from radixlm.runtime.server.http_server import create_app

API_KEY = "test-key"
LONG_CONTEXT = {"context_length": 4096, "max_total_tokens": 16384}
"""The abort tests' engine: requests that run for thousands of steps, so that an abort posted
after the first streamed chunk reaches the scheduler long before they could end by length,
however the machine's cores are contended."""
ABORTED_BUDGET = 3000


def serve(engine):
    live = LiveServer(create_app(engine, api_key=API_KEY))
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=live.url, headers=headers, timeout=60) as client:
        yield client
    live.close()


@pytest.fixture
def server(engine_for):
    yield from serve(engine_for())


@pytest.fixture
def long_server(engine_for):
    yield from serve(engine_for(**LONG_CONTEXT))


def test_generate_matches_the_engine_single_batch_and_input_ids(server, engine_for):
    engine = engine_for()
    expected = engine.generate(PROMPTS[:2], greedy(8))
    single = server.post("/generate", json={"text": PROMPTS[0], "sampling_params": greedy(8)})
    assert single.status_code == 200
    assert single.json()["output_ids"] == expected[0]["output_ids"]
    assert single.json()["text"] == expected[0]["text"]
    batch = server.post("/generate", json={"text": PROMPTS[:2], "sampling_params": greedy(8)})
    assert [o["output_ids"] for o in batch.json()] == [o["output_ids"] for o in expected]
    ids = engine.tokenizer.encode(PROMPTS[1])
    by_ids = server.post("/generate", json={"input_ids": ids, "sampling_params": greedy(8)})
    assert by_ids.json()["output_ids"] == expected[1]["output_ids"]


def test_streaming_sends_cumulative_chunks_then_done(server, engine_for):
    expected = engine_for().generate(PROMPTS[2], greedy(10))
    body = {"text": PROMPTS[2], "sampling_params": greedy(10), "stream": True}
    events = []
    with server.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["output_ids"] == expected["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    assert all(expected["text"].startswith(c["text"]) for c in chunks)


def test_prefill_only_request_caches_the_prompt(server, engine_for):
    engine_for().flush_cache()
    ids = list(range(20, 60))
    first = server.post("/generate", json={"input_ids": ids,
                                           "sampling_params": {"max_new_tokens": 0}})
    assert first.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert first.json()["text"] == ""
    again = server.post("/generate", json={"input_ids": ids, "sampling_params": greedy(2)})
    assert again.json()["meta_info"]["cached_tokens"] == len(ids) - 1


def test_logprobs_over_http(server):
    body = {"text": PROMPTS[1], "sampling_params": greedy(3), "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": 2, "return_text_in_logprobs": True}
    meta = server.post("/generate", json=body).json()["meta_info"]
    assert meta["input_token_logprobs"][0][0] is None
    assert len(meta["output_token_logprobs"]) == 3
    assert all(isinstance(entry[2], str) for entry in meta["output_token_logprobs"])
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])


@pytest.mark.parametrize(("body", "field"), [
    ({"text": "hi", "sampling_params": {"temperature": -1}}, "temperature"),
    ({"text": "hi", "sampling_params": {"top_p": 0}}, "top_p"),
    ({"text": "hi", "sampling_params": {"bogus": 1}}, "bogus"),
    ({"text": "hi", "surprise": True}, "surprise"),
    ({"text": "hi", "input_ids": [1, 2]}, "input_ids"),
    ({"text": 5}, "text"),
    ({"text": "x" * 5000}, "context"),
])
def test_bad_input_is_a_400_naming_the_field_and_the_server_keeps_serving(server, body, field):
    response = server.post("/generate", json=body)
    assert response.status_code == 400
    assert field in response.json()["error"]["message"]
    ok = server.post("/generate", json={"text": PROMPTS[0], "sampling_params": greedy(2)})
    assert ok.status_code == 200


def test_bad_json_is_a_400(server):
    response = server.post("/generate", content=b"{not json",
                           headers={"content-type": "application/json"})
    assert response.status_code == 400


def test_api_key_guards_every_route_but_health(server):
    url = str(server.base_url)
    with httpx.Client(base_url=url, timeout=30) as anonymous:
        assert anonymous.get("/health").status_code == 200
        for method, path in [("GET", "/get_model_info"), ("GET", "/get_server_info"),
                             ("POST", "/generate"), ("POST", "/flush_cache")]:
            assert anonymous.request(method, path).status_code == 401
        wrong = anonymous.get("/get_model_info", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        for scheme in ("bearer", "BEARER"):  # the scheme is case-insensitive
            given = anonymous.get("/get_model_info",
                                  headers={"Authorization": f"{scheme} {API_KEY}"})
            assert given.status_code == 200
        for header in (API_KEY, f"Basic {API_KEY}", f"Bearer {API_KEY}x"):
            assert anonymous.get("/get_model_info",
                                 headers={"Authorization": header}).status_code == 401
        # Anthropic's clients send the key as x-api-key.
        assert anonymous.get("/get_model_info",
                             headers={"x-api-key": API_KEY}).status_code == 200
        for key in ("", "nope", f"{API_KEY}x"):
            assert anonymous.post("/v1/messages", headers={"x-api-key": key}).status_code == 401


def test_info_routes_and_health_generate(server, engine_for):
    info = server.get("/get_model_info").json()
    assert info["is_generation"] is True and info["architectures"] == ["LlamaForCausalLM"]
    assert server.get("/model_info").json() == info
    server_info = server.get("/get_server_info").json()
    assert server_info["max_total_tokens"] == engine_for().max_total_tokens
    assert {"free_kv_tokens", "cache_tokens", "num_running"} <= set(server_info)
    assert server.get("/health_generate").status_code == 200


def test_flush_cache_and_abort_request(long_server):
    assert long_server.post("/flush_cache").status_code == 200
    assert long_server.post("/abort_request", json={"abort_all": True}).status_code == 200
    assert long_server.post("/abort_request", json={}).status_code == 400
    body = {"text": [PROMPTS[0]] * 2, "stream": True, "rid": ["a", "b"],
            "sampling_params": [greedy(ABORTED_BUDGET), greedy(400)]}
    finals = finish_reasons_of_a_stream_aborted_midway(long_server, body, {"rid": "a"})
    assert finals[0]["type"] == "abort"
    assert finals[1] == {"type": "length", "length": 400}


def test_an_output_budget_beyond_the_context_is_a_400(server):
    body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 100_000}}
    response = server.post("/generate", json=body)
    assert response.status_code == 400
    assert "max_new_tokens" in response.json()["error"]["message"]


def test_abort_all_ends_every_running_request_with_abort(long_server):
    body = {"text": PROMPTS[:4], "sampling_params": greedy(ABORTED_BUDGET), "stream": True}
    finals = finish_reasons_of_a_stream_aborted_midway(long_server, body, {"abort_all": True})
    assert {index: reason["type"] for index, reason in finals.items()} == {
        0: "abort", 1: "abort", 2: "abort", 3: "abort"
    }


def finish_reasons_of_a_stream_aborted_midway(server, body: dict, abort: dict) -> dict:
    """Streams ``body``, posts ``abort`` to /abort_request once the first chunk arrives, and
    returns each prompt's finish reason by index."""
    finals: dict[int, dict] = {}
    aborted = False
    with server.stream("POST", "/generate", json=body) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            if not aborted:
                assert server.post("/abort_request", json=abort).status_code == 200
                aborted = True
            if chunk["meta_info"]["finish_reason"] is not None:
                finals[chunk["index"]] = chunk["meta_info"]["finish_reason"]
    return finals
