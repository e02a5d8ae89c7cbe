"""Reasoning in ``/v1/chat/completions`` (``--reasoning-parser``), served with a tiny random
model whose output a regex makes think: ``reasoning_content`` whole and streamed, SGLang's
``separate_reasoning`` and ``stream_reasoning`` switches, and the thinking budget."""

from __future__ import annotations

import re

import openai
import pytest
from live_server import LiveServer

from radixlm.runtime.server.http_server import create_app

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
THINKING = "<think>[a-z]{2,12}( [a-z]{2,12}){0,6}</think>\n\n[A-Z][a-z]{2,10}"
ASK = [{"role": "user", "content": "Why?"}]


@pytest.fixture
def client(engine_for, monkeypatch):
    engine = engine_for(reasoning_parser="qwen3")
    monkeypatch.setattr(engine.tokenizer, "chat_template", CHAT_TEMPLATE, raising=False)
    server = LiveServer(create_app(engine, served_model_name="tiny"))
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as client:
        yield client
    server.close()


def ask(client, **extra):
    return client.chat.completions.create(
        model="tiny", messages=ASK, temperature=0, max_tokens=60,
        extra_body={"regex": THINKING, **extra})


def test_reasoning_is_split_from_the_content(client):
    raw = ask(client, separate_reasoning=False).choices[0].message
    assert raw.model_extra.get("reasoning_content") is None
    thought, answer = re.fullmatch(r"<think>(.*)</think>\n\n(.*)", raw.content, re.S).groups()
    split = ask(client).choices[0].message
    assert split.model_extra["reasoning_content"] == thought
    assert split.content == answer


def test_streamed_reasoning_adds_up_to_the_whole(client):
    whole = ask(client).choices[0].message
    stream = client.chat.completions.create(
        model="tiny", messages=ASK, temperature=0, max_tokens=60, stream=True,
        extra_body={"regex": THINKING})
    reasoning, content, reasoning_chunks = "", "", 0
    for chunk in stream:
        for choice in chunk.choices:
            piece = (choice.delta.model_extra or {}).get("reasoning_content")
            if piece:
                reasoning += piece
                reasoning_chunks += 1
                assert not content, "reasoning after content"
            content += choice.delta.content or ""
    assert (reasoning, content) == (whole.model_extra["reasoning_content"], whole.content)
    assert reasoning_chunks > 1, "reasoning was not streamed"


def test_stream_reasoning_false_sends_it_in_the_last_chunk(client):
    stream = client.chat.completions.create(
        model="tiny", messages=ASK, temperature=0, max_tokens=60, stream=True,
        extra_body={"regex": THINKING, "stream_reasoning": False})
    chunks = [chunk for chunk in stream if chunk.choices]
    carrying = [i for i, chunk in enumerate(chunks)
                if (chunk.choices[0].delta.model_extra or {}).get("reasoning_content")]
    assert carrying == [len(chunks) - 1]
    assert chunks[-1].choices[0].finish_reason is not None


def test_a_budget_does_not_force_an_end_of_thinking_into_an_answer(client):
    """With the template's thinking switched off there is no thinking to end: nothing is
    forced (``</think>`` in the content would be)."""
    out = client.chat.completions.create(
        model="tiny", messages=ASK, temperature=0, max_tokens=12,
        extra_body={"ignore_eos": True, "max_reasoning_tokens": 2,
                    "chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert "</think>" not in out.content
    assert out.model_extra.get("reasoning_content") is None


def test_a_thinking_budget_ends_the_thinking(engine_for, monkeypatch):
    """deepseek-r1's template opens the thinking in the prompt: a random model never closes
    it, unless the budget forces ``</think>`` after that many tokens."""
    engine = engine_for(reasoning_parser="deepseek-r1")
    monkeypatch.setattr(engine.tokenizer, "chat_template", CHAT_TEMPLATE, raising=False)
    server = LiveServer(create_app(engine, served_model_name="tiny"))
    try:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as client:
            def think(**extra):
                return client.chat.completions.create(
                    model="tiny", messages=ASK, temperature=0, max_tokens=20, logprobs=True,
                    extra_body={"ignore_eos": True, **extra}).choices[0]

            free = think()
            budget = think(max_reasoning_tokens=5)
    finally:
        server.close()
    end = [engine.tokenizer.decode([i])
           for i in engine.tokenizer.encode("</think>", add_special_tokens=False)]
    tokens = [entry.token for entry in budget.logprobs.content]
    assert tokens[5:5 + len(end)] == end  # forced right after the budget's 5 tokens
    assert free.message.content in ("", None)  # never closed: all reasoning
    assert budget.message.content, "nothing was written after the forced end of thinking"
    # Greedy: the same first five tokens, then the budget's end of thinking.
    assert [entry.token for entry in free.logprobs.content][:5] == tokens[:5]
