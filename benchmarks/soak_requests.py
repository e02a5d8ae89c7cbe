"""The abusive requests of ``bench_soak.py``, one kind at a time, and what a soak's requests
are sent with (``Target``, ``greedy``, fresh prompt ids)."""

from __future__ import annotations

import dataclasses
import json
import random

import httpx


@dataclasses.dataclass
class Target:
    client: httpx.AsyncClient
    model: str
    vocab_size: int


def greedy(tokens: int, **extra) -> dict:
    return {"max_new_tokens": tokens, "temperature": 0.0, **extra}


def random_ids(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    # Fresh ids above the special tokens, so the prefix cache serves none of the prompt.
    return [rng.randrange(100, vocab_size) for _ in range(count)]


async def forty_mib():
    for _ in range(40):
        yield b" " * 2**20


def abusive_request(kind: str, target: Target, rng: random.Random) -> tuple[str, dict]:
    """(path, httpx ``post`` arguments) of one request of an abusive kind."""
    text = f"Count slowly from {rng.randrange(1000)}:"

    def generate(params: dict, **extra) -> tuple[str, dict]:
        return "/generate", {"json": {"text": text, "sampling_params": params, **extra}}

    if kind == "stop_regex_backtracking":
        return generate(greedy(16, ignore_eos=True, stop_regex="(.+)+X"))
    if kind == "lone_surrogate":  # valid JSON text, but no valid Unicode once decoded
        body = json.dumps({"text": text, "sampling_params": greedy(4, stop=["SURROGATE"])})
        return "/generate", {"content": body.replace("SURROGATE", "\\udc00").encode(),
                             "headers": {"content-type": "application/json"}}
    if kind in ("huge_top_logprobs", "max_logprobs_prompt"):
        top, length = (100_000, 16) if kind == "huge_top_logprobs" else (20, 2000)
        return "/generate", {"json": {
            "input_ids": random_ids(rng, length, target.vocab_size), "sampling_params": greedy(1),
            "return_logprob": True, "top_logprobs_num": top, "logprob_start_len": 0}}
    if kind in ("many_stop_strings", "stop_strings_at_cap"):
        count, chars = (10_000, 500) if kind == "many_stop_strings" else (64, 64)
        return generate(greedy(4, stop=[f"{i:0{chars}d}" for i in range(count)]))
    if kind == "chunked_upload":  # no Content-Length: the limit must hold while reading
        return "/generate", {"content": forty_mib(),
                             "headers": {"content-type": "application/json"}}
    if kind == "duplicate_rid":
        rid = f"soak-{rng.randrange(10**9)}"
        return "/generate", {"json": {"text": [text, text + " again"], "rid": [rid, rid],
                                      "sampling_params": greedy(4)}}
    if kind == "client_leaves":
        path, request = generate(greedy(1000, ignore_eos=True))
        return path, {**request, "timeout": 0.5}
    if kind == "long_prefill":
        return "/generate", {"json": {"input_ids": random_ids(rng, 7000, target.vocab_size),
                                      "sampling_params": greedy(1)}}
    if kind == "huge_chat":
        messages = [{"role": "user", "content": "a" * 2_000_000}]
        return "/v1/chat/completions", {"json": {"model": target.model, "messages": messages,
                                                 "max_tokens": 1}}
    if kind == "n_over_cap":
        return generate(greedy(1, n=10_000))
    return issue_54_request(kind, target, generate)


def issue_54_request(kind: str, target: Target, generate) -> tuple[str, dict]:
    """The abusive kinds of issue 54's second round (``abusive_request``'s)."""
    beam = {"use_beam_search": True, "n": 2}
    if kind == "beam_negative_length_penalty":
        return generate(greedy(8, **beam, length_penalty=-100))
    if kind == "beam_huge_length_penalty":
        return generate(greedy(8, **beam, length_penalty=1000))
    if kind == "beam_min_tokens_all_stop":
        return generate(greedy(8, **beam, min_new_tokens=4,
                               stop_token_ids=list(range(target.vocab_size))))
    chat = {"model": target.model, "max_tokens": 1,
            "messages": [{"role": "user", "content": "hi"}]}
    if kind == "client_chat_template":
        template = "{% for i in range(2000) %}{{ 'x' * 100000 }}{% endfor %}"  # 200 MB
        return "/v1/chat/completions", {"json": {
            **chat, "chat_template_kwargs": {"chat_template": template}}}
    if kind == "render_option_in_template_kwargs":
        return "/v1/chat/completions", {"json": {
            **chat, "chat_template_kwargs": {"tokenizer_kwargs": {"max_length": 1}}}}
    if kind == "template_variable_of_wrong_type":
        return "/v1/chat/completions", {"json": {**chat, "chat_template_kwargs": {"documents": 5}}}
    if kind == "empty_messages":
        return "/v1/chat/completions", {"json": {**chat, "messages": [{"role": "user"}] * 600_000}}
    if kind == "stop_token_ids_times_n":
        return generate(greedy(1, n=16, stop_token_ids=[7] * 500_000))
    if kind == "seed_over_64_bits":
        return generate(greedy(1, sampling_seed=2**64))
    if kind == "min_new_tokens_over_64_bits":
        return generate(greedy(1, min_new_tokens=2**70))
    if kind == "top_k_over_64_bits_streamed":
        return generate(greedy(1, top_k=2**64), stream=True)
    if kind == "recursive_ebnf":
        return generate(greedy(8, ebnf='root ::= "a" root'))
    if kind == "self_referencing_schema":
        schema = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
        return generate(greedy(8, json_schema=json.dumps(schema)))
    if kind == "exponential_ebnf":  # finite, but 2^40 bytes long
        rules = [f"a{i} ::= a{i + 1} a{i + 1}" for i in range(40)] + ['a40 ::= "x"']
        return generate(greedy(8, ebnf="\n".join(["root ::= a0", *rules])))
    raise ValueError(f"unknown abusive kind {kind!r}")
