"""Streamed ``/generate`` with logprobs, cumulative and incremental
(``--incremental-streaming-output``), over a real server on 127.0.0.1 and the Engine's own
streaming API; and SGLang's frontend test of streamed logprobs against our server.

However the steps fall into chunks, an incremental stream's segments concatenate to what
the cumulative stream ends with, and every chunk's ``output_token_logprobs_length`` counts
the output so far.
"""

from __future__ import annotations

import json

import httpx
import pytest
from live_server import LiveServer
from workloads import PROMPTS, greedy

import radixlm
from radixlm.runtime.server.http_server import create_app

INCREMENTAL = {"incremental_streaming_output": True}
LOGPROBS = {"return_logprob": True, "top_logprobs_num": 2}


def stream_chunks(url: str, body: dict) -> list[dict]:
    """The chunks of a streamed ``/generate`` (the stream must end with ``[DONE]``)."""
    events = []
    with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True},
                      timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def joined(chunks: list[dict]) -> dict:
    """An incremental stream's segments put end to end."""
    parts = {"text": "".join(c["text"] for c in chunks),
             "output_ids": [i for c in chunks for i in c["output_ids"]]}
    for name in ("output_token_logprobs", "output_top_logprobs"):
        parts[name] = [entry for c in chunks for entry in c["meta_info"][name]]
    return parts


def assert_same_logprobs(got: list, expected: list) -> None:
    """Same tokens (and top tokens) in order, logprobs equal to float32 rounding."""
    assert [e[1] for e in got] == [e[1] for e in expected]
    assert [e[0] for e in got] == pytest.approx([e[0] for e in expected], abs=1e-4)


def assert_segments_count_the_output(chunks: list[dict]) -> None:
    """Each incremental chunk: its logprobs are its own tokens'; the counters count all."""
    done = 0
    for chunk in chunks:
        meta = chunk["meta_info"]
        assert len(meta["output_token_logprobs"]) == len(chunk["output_ids"])
        assert len(meta["output_top_logprobs"]) == len(chunk["output_ids"])
        done += len(chunk["output_ids"])
        assert meta["completion_tokens"] == meta["output_token_logprobs_length"] == done


@pytest.fixture
def servers(engine_for):
    """URLs of a cumulative and an incremental server over the same tiny model."""
    live = [LiveServer(create_app(engine_for())), LiveServer(create_app(engine_for(**INCREMENTAL)))]
    yield live[0].url, live[1].url
    for server in live:
        server.close()


def test_incremental_segments_concatenate_to_the_cumulative_streams_end(servers):
    cumulative_url, incremental_url = servers
    body = {"text": PROMPTS[1], "sampling_params": greedy(24), **LOGPROBS}
    cumulative = stream_chunks(cumulative_url, body)
    incremental = stream_chunks(incremental_url, body)
    whole, parts = cumulative[-1], joined(incremental)
    assert parts["text"] == whole["text"]
    assert parts["output_ids"] == whole["output_ids"] and len(parts["output_ids"]) == 24
    assert_same_logprobs(parts["output_token_logprobs"],
                         whole["meta_info"]["output_token_logprobs"])
    expected_top = whole["meta_info"]["output_top_logprobs"]
    assert len(parts["output_top_logprobs"]) == len(expected_top)
    for got, expected in zip(parts["output_top_logprobs"], expected_top, strict=True):
        assert_same_logprobs(got, expected)
    assert_segments_count_the_output(incremental)
    assert incremental[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]


def test_cumulative_chunks_report_the_length_of_their_logprobs(servers):
    cumulative_url, _ = servers
    body = {"text": PROMPTS[0], "sampling_params": greedy(12), **LOGPROBS}
    previous = ""
    for chunk in stream_chunks(cumulative_url, body):
        meta = chunk["meta_info"]
        assert meta["output_token_logprobs_length"] == len(meta["output_token_logprobs"])
        assert meta["output_token_logprobs_length"] == meta["completion_tokens"]
        assert meta["completion_tokens"] == len(chunk["output_ids"])
        assert chunk["text"].startswith(previous)
        previous = chunk["text"]


def test_a_batched_incremental_stream_keeps_each_prompts_segments_apart(servers, engine_for):
    _, incremental_url = servers
    prompts = PROMPTS[:3]
    body = {"text": prompts, "sampling_params": greedy(10), **LOGPROBS}
    by_index: dict[int, list[dict]] = {i: [] for i in range(len(prompts))}
    for chunk in stream_chunks(incremental_url, body):
        by_index[chunk["index"]].append(chunk)
    expected = engine_for().generate(prompts, greedy(10), **LOGPROBS)
    for index, chunks in by_index.items():
        parts = joined(chunks)
        assert parts["text"] == expected[index]["text"]
        assert parts["output_ids"] == expected[index]["output_ids"]
        assert_same_logprobs(parts["output_token_logprobs"],
                             expected[index]["meta_info"]["output_token_logprobs"])
        assert_segments_count_the_output(chunks)


def test_the_engines_stream_is_incremental_when_the_engine_is(engine_for):
    engine = engine_for(**INCREMENTAL)
    whole = engine.generate(PROMPTS[3], greedy(16), **LOGPROBS)
    chunks = list(engine.generate(PROMPTS[3], greedy(16), stream=True, **LOGPROBS))
    parts = joined(chunks)
    assert parts["text"] == whole["text"] and parts["output_ids"] == whole["output_ids"]
    assert_same_logprobs(parts["output_token_logprobs"],
                         whole["meta_info"]["output_token_logprobs"])
    assert_segments_count_the_output(chunks)
    assert whole["meta_info"]["output_token_logprobs_length"] == 16


FRONTEND_ATTEMPTS = 10
"""SGLang's frontend reads a streamed variable on one thread while another writes it: when
two chunks land between two of its reads, the earlier chunk's meta_info is overwritten
unread and its test fails, on our server as on SGLang's. The tiny test models step every
millisecond or two, faster than that reader wakes on a loaded machine (CI saw ten attempts
in a row fail, the first read coming seven chunks late); the test therefore runs against the
default model, whose steps take as long as those of the models SGLang's own CI serves. A
server whose chunks drop, repeat or miscount logprobs fails every attempt."""


@pytest.mark.sglang_frontend
@pytest.mark.default_model
def test_sglangs_own_stream_logprobs_test_passes_against_an_incremental_server():
    """``sglang.test.test_programs.test_stream_logprobs``, run as SGLang's CI runs it (its
    server with ``--incremental-streaming-output``): each chunk's logprobs are its tokens'."""
    sgl = pytest.importorskip("sglang", reason="the SGLang frontend is installed in CI's 2nd stage")
    from sglang.lang.global_config import global_config
    from sglang.test import test_programs

    previous = global_config.default_backend
    failures = []
    with radixlm.Engine(max_total_tokens=4096, **INCREMENTAL) as engine:
        server = LiveServer(create_app(engine))
        try:
            sgl.set_default_backend(sgl.RuntimeEndpoint(server.url))
            while len(failures) < FRONTEND_ATTEMPTS:
                try:
                    test_programs.test_stream_logprobs()
                    break
                except AssertionError as failure:
                    failures.append(failure)
        finally:
            global_config.default_backend = previous
            server.close()
    assert len(failures) < FRONTEND_ATTEMPTS, failures
