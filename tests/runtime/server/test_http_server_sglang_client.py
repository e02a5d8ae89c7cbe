"""SGLang's own frontend (``sglang.RuntimeEndpoint``) running programs against our server.

Needs the ``sglang`` package (installed without its dependencies, in CI's second stage:
see .ci/run); skipped where it is not installed.
"""

from __future__ import annotations

import pytest
from live_server import LiveServer

from radixlm.runtime.server.http_server import create_app

sgl = pytest.importorskip("sglang", reason="the SGLang frontend is installed in CI's 2nd stage")

pytestmark = pytest.mark.sglang_frontend


@pytest.fixture
def endpoint(engine_for):
    server = LiveServer(create_app(engine_for()))
    backend = sgl.RuntimeEndpoint(server.url)
    yield backend
    server.close()


@sgl.function
def question(s, text):
    s += "Q: " + text + "\nA:"
    s += sgl.gen("answer", max_tokens=8, temperature=0)


@sgl.function
def choose(s, text):
    s += "Question: " + text + "\nAnswer:"
    s += sgl.select("choice", choices=[" yes", " no", " maybe"])


@sgl.function
def branches(s):
    s += "The quick brown fox"
    forks = s.fork(3)
    for i, fork in enumerate(forks):
        fork += f" branch {i}:"
        fork += sgl.gen("more", max_tokens=4, temperature=0)
    forks.join()
    s += "".join(fork["more"] for fork in forks)


def test_gen_returns_the_servers_greedy_text(endpoint, engine_for):
    state = question.run(text="The capital of France?", backend=endpoint)
    prompt = "Q: The capital of France?\nA:"
    expected = engine_for().generate(prompt, {"max_new_tokens": 8, "temperature": 0})
    assert state["answer"] == expected["text"]
    assert state.get_meta_info("answer")["completion_tokens"] == 8


def test_select_picks_one_of_the_choices(endpoint):
    state = choose.run(text="Is the sky blue?", backend=endpoint)
    assert state["choice"] in (" yes", " no", " maybe")


def test_fork_and_join_run_every_branch_on_the_shared_prefix(endpoint, engine_for):
    state = branches.run(backend=endpoint)
    params = {"max_new_tokens": 4, "temperature": 0}
    expected = [
        engine_for().generate(f"The quick brown fox branch {i}:", params)["text"]
        for i in range(3)
    ]
    assert state.text() == "The quick brown fox" + "".join(expected)


def test_run_batch_returns_every_item(endpoint):
    states = question.run_batch([{"text": f"item {i}"} for i in range(8)], backend=endpoint)
    assert len(states) == 8 and all(isinstance(s["answer"], str) for s in states)


def test_streaming_text_iter_builds_the_answer(endpoint):
    state = question.run(text="Streaming?", backend=endpoint, stream=True)
    pieces = list(state.text_iter("answer"))
    assert "".join(pieces) == state["answer"]
