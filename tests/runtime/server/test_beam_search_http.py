"""Beam search over HTTP, on a live uvicorn server: the native ``/generate`` returns the
Engine's beams and refuses a conflicting field with a 400 naming it; ``/v1/completions``, driven
by the official ``openai`` client, takes ``use_beam_search``, ``length_penalty`` and
``early_stopping`` as extra body fields, with ``n`` the width, and returns transformers'
hypotheses best first."""

from __future__ import annotations

import httpx
import openai
import pytest
from beam_reference import beam, reference_beams
from live_server import LiveServer
from workloads import greedy, random_ids

from radixlm.runtime.server.http_server import create_app

MODEL = "tiny"


@pytest.fixture
def live(engine_for):
    """(server url, engine)."""
    engine = engine_for()
    server = LiveServer(create_app(engine, served_model_name=MODEL))
    yield server.url, engine
    server.close()


@pytest.fixture
def client(live):
    """The official client, pointed at the live server, without retries."""
    url = live[0]
    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as openai_client:
        yield openai_client


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
