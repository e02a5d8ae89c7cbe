"""The frontend makes shared prefixes cache hits: run_batch caches the program's constant
prefix before its items run, fork caches the parent before the branches run."""

from __future__ import annotations

import pytest

import radixlm as sgl

pytestmark = [pytest.mark.default_model, pytest.mark.slow]  # CI runs it in its last stage

FACTS = [
    ("Which planet is known as the red planet?", "Mars"),
    ("What gas do plants absorb from the air?", "Carbon dioxide"),
    ("How many continents are there on Earth?", "Seven"),
    ("What is the largest ocean on Earth?", "The Pacific Ocean"),
    ("Who wrote the play Romeo and Juliet?", "William Shakespeare"),
    ("What is the boiling point of water at sea level in Celsius?", "100 degrees"),
    ("Which metal is liquid at room temperature?", "Mercury"),
    ("What is the hardest natural substance?", "Diamond"),
]
INSTRUCTIONS = ("You are a quiz assistant. Answer every question with a short, factual "
                "answer of at most five words, without explanations. ")


@sgl.function
def few_shot(s, question):
    s += sgl.system(INSTRUCTIONS * 4)
    for shot_question, shot_answer in FACTS * 3:
        s += sgl.user(shot_question) + sgl.assistant(shot_answer)
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=4))


def test_run_batch_reports_the_shared_prefix_cached_on_every_item(default_engine):
    sgl.flush_cache(default_engine)
    prefix = few_shot.trace(backend=default_engine).prefix
    prefix_tokens = len(default_engine.tokenizer.encode(prefix))
    assert prefix_tokens >= 500
    questions = [{"question": f"What is {n} times 3?"} for n in range(32)]
    states = few_shot.run_batch(questions, backend=default_engine, temperature=0)
    cached = [state.get_meta_info("answer")["cached_tokens"] for state in states]
    assert all(c >= 0.9 * prefix_tokens for c in cached[1:]), (prefix_tokens, cached)


def test_fork_reports_the_parent_cached_in_every_branch(default_backend, default_engine):
    @sgl.function
    def branches(s):
        s += sgl.system(INSTRUCTIONS * 4)
        s += sgl.user("Name a colour.")
        s += sgl.assistant_begin()
        s["parent_text"] = s.text()
        forks = s.fork(4)
        forks += lambda i: f"Option {i + 1}: " + sgl.gen("colour", max_tokens=3)
        forks.join()
        s += sgl.assistant_end()

    sgl.flush_cache(default_backend)
    state = branches.run(backend=default_backend, temperature=0.8)
    metas = state.get_meta_info("colour")
    assert len(metas) == 4
    parent_tokens = len(default_engine.tokenizer.encode(state["parent_text"]))
    # Every branch finds the parent in the cache (its last token may merge with the branch's).
    assert all(meta["cached_tokens"] >= parent_tokens - 1 for meta in metas), metas
