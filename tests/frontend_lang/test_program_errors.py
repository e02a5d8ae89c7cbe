"""Every way a program can fail ends in an exception that names the cause; nothing hangs and
a failing ``run_batch`` item loses nobody else's results."""

from __future__ import annotations

import time

import pytest
from live_server import LiveServer, free_port

import radixlm as sgl
from radixlm.runtime.server.http_server import create_app


@pytest.fixture
def engine(engine_for):
    return engine_for()


def test_a_program_that_raises_raises_from_run(engine):
    @sgl.function
    def program(s):
        s += "Start" + sgl.gen("x", max_tokens=2)
        raise LookupError("no such thing")

    with pytest.raises(LookupError, match="no such thing"):
        program.run(backend=engine)


def test_a_program_that_raises_leaves_nothing_running(engine):
    @sgl.function
    def program(s):
        s += "Start" + sgl.gen("x", max_tokens=200, ignore_eos=True)
        while engine.get_server_info()["num_running"] == 0:
            time.sleep(0.001)  # the gen is under way
        raise LookupError("no such thing")

    with pytest.raises(LookupError):
        program.run(backend=engine)
    assert engine.get_server_info()["num_running"] == 0  # the gen in flight has ended


def test_a_failing_run_batch_item_keeps_the_others(engine):
    @sgl.function
    def program(s, word):
        s += "Say " + word + sgl.gen("x", max_tokens=2, temperature=0)
        if word == "bad":
            raise RuntimeError(f"cannot handle {word}")

    states = program.run_batch([{"word": w} for w in ["fox", "bad", "dog"]], backend=engine)
    assert isinstance(states[1].error(), RuntimeError)
    assert states[0].error() is None and states[2].error() is None
    assert states[0].text().startswith("Say fox") and states[2]["x"] is not None
    with pytest.raises(sgl.ProgramError, match="cannot handle bad"):
        states[1].text()


def test_an_unknown_variable_is_a_key_error_naming_it(engine):
    @sgl.function
    def program(s):
        s += "A" + sgl.gen("known", max_tokens=1)

    state = program.run(backend=engine)
    with pytest.raises(KeyError, match="'unknown'.*known"):
        state["unknown"]
    assert "unknown" not in state and "known" in state


@pytest.mark.parametrize("expr,cause,message", [
    (sgl.user_begin() + sgl.assistant_begin(), ValueError, "roles do not nest"),
    (sgl.user_end(), ValueError, "open role is None"),
    (sgl.image("cat.png"), ValueError, "text-only"),
    (sgl.gen("x", n=2), ValueError, "use s.fork"),
    (sgl.gen("x", top_p=5.0), ValueError, "top_p"),
])
def test_a_failing_expression_becomes_a_program_error_with_its_cause(engine, expr, cause,
                                                                      message):
    @sgl.function
    def program(s):
        s += "Hello "
        s += expr
        s += "never written"

    with pytest.raises(sgl.ProgramError, match=message) as caught:
        program.run(backend=engine)
    assert isinstance(caught.value.__cause__, cause)


def test_bad_run_arguments_name_the_argument(engine):
    @sgl.function
    def program(s, question):
        s += question

    with pytest.raises(TypeError, match="question"):
        program.run(backend=engine)
    with pytest.raises(TypeError, match=r"batch_kwargs\[1\].*missing.*'question'"):
        program.run_batch([{"question": "a"}, {"answer": "b"}], backend=engine)
    with pytest.raises(TypeError, match=r"batch_kwargs\[0\].*unexpected.*'answer'"):
        program.run_batch([{"question": "a", "answer": "b"}], backend=engine)
    with pytest.raises(TypeError, match="list of dicts"):
        program.run_batch("question", backend=engine)
    with pytest.raises(ValueError, match="num_threads"):
        program.run_batch([{"question": "a"}], backend=engine, num_threads=0)


def test_a_server_that_is_down_is_named():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(sgl.BackendError, match=f"cannot reach the server at {url}"):
        sgl.RuntimeEndpoint(url)


def test_a_server_that_goes_down_or_refuses_fails_the_program(engine):
    live = LiveServer(create_app(engine, api_key="secret"))
    try:
        with pytest.raises(sgl.BackendError, match="HTTP 401"):
            sgl.RuntimeEndpoint(live.url)
        backend = sgl.RuntimeEndpoint(live.url, api_key="secret")

        @sgl.function
        def program(s, top_p):
            s += "Hi" + sgl.gen("x", max_tokens=2, top_p=top_p)

        assert program.run(1.0, backend=backend)["x"] is not None
        with pytest.raises(sgl.ProgramError, match="HTTP 400.*top_p") as caught:
            program.run(7.0, backend=backend)
        assert isinstance(caught.value.__cause__, sgl.BackendError)
    finally:
        live.close()
    with pytest.raises(sgl.ProgramError, match="cannot reach the server") as caught:
        program.run(1.0, backend=backend)
    assert isinstance(caught.value.__cause__, sgl.BackendError)


def test_a_failure_while_streaming_ends_the_iteration_with_the_cause(engine):
    @sgl.function
    def program(s):
        s += "Hello" + sgl.gen("x", max_tokens=3)
        s += sgl.gen("y", top_k=0)

    state = program.run(backend=engine, stream=True)
    with pytest.raises(sgl.ProgramError, match="top_k"):
        list(state.text_iter())
    with pytest.raises(sgl.ProgramError, match="top_k"):
        state["y"]
