"""Programs against the in-process Engine on a tiny model: what ``s`` holds after each kind
of expression, checked against direct Engine calls on the same text."""

from __future__ import annotations

import asyncio

import pytest

import radixlm as sgl

GREEDY = {"temperature": 0, "max_new_tokens": 6}


@pytest.fixture
def engine(engine_for):
    return engine_for()


def direct(engine, text: str, **params) -> str:
    return engine.generate(text, {**GREEDY, **params})["text"]


def test_gen_continues_exactly_the_text_written_so_far(engine):
    @sgl.function
    def program(s, topic):
        s += "The quick brown fox " + topic
        s += sgl.gen("a", max_tokens=5)
        s += " and " + sgl.gen("b", stop="o")

    state = program.run("jumps", backend=engine, **GREEDY)
    first = direct(engine, "The quick brown fox jumps", max_new_tokens=5)
    assert state["a"] == first
    assert state["b"] == direct(engine, f"The quick brown fox jumps{first} and ", stop="o")
    assert state.text() == f"The quick brown fox jumps{first} and {state['b']}"
    meta = state.get_meta_info("a")
    assert meta["completion_tokens"] <= 5 and meta["prompt_tokens"] > 0


def test_roles_render_with_the_backend_template_and_become_messages(engine):
    @sgl.function
    def chat(s):
        s += sgl.system("Be brief.")
        with s.user():
            s += "Hi"
        s += sgl.assistant(sgl.gen("reply", max_tokens=3))

    state = chat.run(backend=engine, **GREEDY)
    reply = state["reply"]
    assert state.text() == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi"
                            f"<|im_end|>\n<|im_start|>assistant\n{reply}<|im_end|>\n")
    assert state.messages() == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": reply}]


def test_var_scope_captures_the_text_written_inside_it(engine):
    @sgl.function
    def program(s):
        s += "Name: "
        with s.var_scope("record"):
            s += "Ada, age " + sgl.gen("age", max_tokens=2)
        s += "."

    state = program.run(backend=engine, **GREEDY)
    assert state["record"] == "Ada, age " + state["age"]


def test_fork_branches_share_the_cached_parent_and_join_gathers_lists(engine):
    @sgl.function
    def tree(s):
        s += "Paris is the capital of France; Berlin is the capital of"
        forks = s.fork(3)
        forks += lambda i: f" option {i}:"
        forks += sgl.gen("idea", max_tokens=3)
        forks.join()

    state = tree.run(backend=engine, **GREEDY)
    ideas = state["idea"]
    assert isinstance(ideas, list) and len(ideas) == 3
    for i, idea in enumerate(ideas):
        text = f"Paris is the capital of France; Berlin is the capital of option {i}:"
        assert idea == direct(engine, text, max_new_tokens=3)
    parent_tokens = len(engine.tokenizer.encode(
        "Paris is the capital of France; Berlin is the capital of"))
    cached = [meta["cached_tokens"] for meta in state.get_meta_info("idea")]
    assert all(c >= parent_tokens - 1 for c in cached), (cached, parent_tokens)


def test_join_concatenate_appends_each_branch_in_order(engine):
    @sgl.function
    def program(s):
        s += "Lists:"
        forks = s.fork(2)
        forks += [" one", " two"]
        forks.join("concate_and_append")
        s += "!"

    assert program.run(backend=engine).text() == "Lists: one two!"


def test_nested_forks_and_copy(engine):
    @sgl.function
    def program(s):
        s += "Root"
        outer = s.fork(2)
        for i, branch in enumerate(outer):
            branch += f" {i}"
            inner = branch.fork(2)
            inner += sgl.gen("leaf", max_tokens=2)
            inner.join()
        outer.join()
        copy = s.copy()
        copy += " copied"
        s["copy_text"] = copy.text()

    state = program.run(backend=engine, **GREEDY)
    assert [len(leaves) for leaves in state["leaf"]] == [2, 2]
    assert state["leaf"][1][0] == direct(engine, "Root 1", max_new_tokens=2)
    assert state["copy_text"] == "Root copied"


def test_text_iter_streams_the_variable_in_pieces(engine):
    @sgl.function
    def program(s):
        s += "The quick brown fox"
        s += sgl.gen("story", max_tokens=8)

    state = program.run(backend=engine, stream=True, **GREEDY)
    pieces = list(state.text_iter("story"))  # (the tiny model's bytes may not split)
    assert "".join(pieces) == state["story"] == direct(engine, "The quick brown fox",
                                                        max_new_tokens=8)
    whole = list(state.text_iter())
    assert "".join(whole) == state.text()


def test_text_async_iter(engine):
    @sgl.function
    def program(s):
        s += "Numbers: 0 1 2"
        s += sgl.gen("more", max_tokens=5)

    async def collect():
        state = program.run(backend=engine, stream=True, **GREEDY)
        return state, [piece async for piece in state.text_async_iter("more")]

    state, pieces = asyncio.run(collect())
    assert "".join(pieces) == state["more"]


def test_select_scores_each_choice_as_the_engine_does(engine):
    prompt = "Paris is the capital of"
    choices = [" France", " Germany", " the ocean blue"]

    @sgl.function
    def program(s):
        s += prompt + sgl.select("place", choices=choices)

    state = program.run(backend=engine)
    meta = state.get_meta_info("place")
    expected = []
    prompt_len = len(engine.tokenizer.encode(prompt))
    for choice in choices:
        ids = engine.tokenizer.encode(prompt + choice)
        out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0},
                              return_logprob=True, logprob_start_len=0)
        expected.append([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][
            prompt_len:]])
    assert len(meta["input_token_logprobs"]) == len(expected)
    for got, want in zip(meta["input_token_logprobs"], expected):
        assert got == pytest.approx(want, abs=1e-4)
    means = [sum(lps) / len(lps) for lps in expected]
    assert state["place"] == choices[means.index(max(means))]
    assert state.text() == prompt + state["place"]


def test_run_batch_keeps_order_and_caches_the_shared_prefix(engine):
    @sgl.function
    def program(s, word):
        s += "In 1492, Columbus sailed the ocean blue. Numbers: 0 1 2 3 4 5 6 7 8 9. " + word
        s += sgl.gen("next", max_tokens=2)

    words = ["fox", "dog", "Paris", "Berlin", "ocean"]
    states = program.run_batch([{"word": w} for w in words], backend=engine,
                               progress_bar=True, **GREEDY)
    assert [s.text().split(". ")[-1][:len(w)] for s, w in zip(states, words)] == words
    cached = [s.get_meta_info("next")["cached_tokens"] for s in states]
    assert min(cached) >= 20, cached


def test_a_branch_can_be_appended_to_by_index(engine):
    @sgl.function
    def program(s):
        s += "Root"
        forks = s.fork(2)
        forks[0] += " left"
        forks[1] += " right" + sgl.gen("x", max_tokens=2)
        forks.join()

    state = program.run(backend=engine, **GREEDY)
    assert state["x"] == [None, direct(engine, "Root right", max_new_tokens=2)]


def test_streamed_meta_info_arrives_with_the_pieces(engine):
    @sgl.function
    def program(s):
        s += "Numbers: 0 1 2"
        s += sgl.gen("more", max_tokens=5)

    async def collect():
        state = program.run(backend=engine, stream=True, **GREEDY)
        return [meta async for _, meta in state.text_async_iter("more", return_meta_data=True)]

    metas = asyncio.run(collect())
    assert metas and all(meta is not None and "prompt_tokens" in meta for meta in metas)


@pytest.mark.parametrize("prompt,choices", [
    ("The sky is ", ["blue", "green"]),  # the prompt's trailing space merges into the choice
    ("Reply with A or B. A", [" A", " B"]),  # the prompt ends like the choice begins
])
def test_select_at_token_boundaries(engine, prompt, choices):
    @sgl.function
    def program(s):
        s += prompt + sgl.select("c", choices=choices)

    state = program.run(backend=engine)
    assert state["c"] in choices
    prompt_ids = engine.tokenizer.encode(prompt)
    for choice, scored in zip(choices, state.get_meta_info("c")["input_token_logprobs"]):
        full = engine.tokenizer.encode(prompt + choice)
        shared = next((i for i, (a, b) in enumerate(zip(prompt_ids, full)) if a != b),
                      min(len(prompt_ids), len(full)))
        assert len(scored) == len(full) - shared  # every token the choice changed or added
