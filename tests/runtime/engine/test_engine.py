"""radixlm.Engine.generate end to end on tiny float32 models: the SGLang native API's fields.

Tiny random models produce byte garbage, so stop strings are picked from what the model
actually produced greedily, and EOS is forced with ``logit_bias`` where a test needs it.
"""

from __future__ import annotations

import re

import pytest
from runtime_checks import assert_engine_idle
from workloads import PROMPTS, greedy, sampled

# Batches and per-prompt parameters -------------------------------------------------------


def test_a_list_of_prompts_returns_a_list_in_order(engine_for):
    engine = engine_for()
    alone = [engine.generate(p, greedy()) for p in PROMPTS]
    together = engine.generate(PROMPTS, greedy())
    assert isinstance(together, list) and len(together) == len(PROMPTS)
    for prompt, single, batched in zip(PROMPTS, alone, together, strict=True):
        assert batched["output_ids"] == single["output_ids"]
        assert batched["text"] == single["text"]
        assert batched["meta_info"]["prompt_tokens"] == len(engine.tokenizer.encode(prompt))


def test_a_single_prompt_returns_a_dict_with_the_native_fields(engine_for):
    out = engine_for().generate(PROMPTS[0], greedy(8), rid="my-request")
    assert isinstance(out, dict)
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["id"] == "my-request"
    assert meta["completion_tokens"] == len(out["output_ids"]) == 8
    assert 0 <= meta["cached_tokens"] < meta["prompt_tokens"]
    assert meta["e2e_latency"] >= 0
    assert "input_token_logprobs" not in meta


def test_per_prompt_sampling_params_apply_to_their_own_prompt(engine_for):
    lengths = [1, 5, 9, 3, 0]
    outs = engine_for().generate(PROMPTS, [greedy(n) for n in lengths])
    for n, out in zip(lengths, outs, strict=True):
        assert out["meta_info"]["completion_tokens"] == len(out["output_ids"]) == n
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": n}


def test_one_sampling_params_dict_applies_to_every_prompt(engine_for):
    outs = engine_for().generate(PROMPTS, greedy(6))
    for out in outs:
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}


def test_input_ids_batch_matches_text_batch(engine_for):
    engine = engine_for()
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    by_text = engine.generate(PROMPTS, greedy(8))
    by_ids = engine.generate(input_ids=ids, sampling_params=greedy(8))
    assert [o["output_ids"] for o in by_ids] == [o["output_ids"] for o in by_text]


def test_text_is_the_decode_of_the_output_ids(engine_for):
    engine = engine_for()
    outs = engine.generate(PROMPTS, greedy(40)) + engine.generate(PROMPTS, sampled(5, 40))
    for out in outs:
        assert out["text"] == engine.tokenizer.decode(out["output_ids"], skip_special_tokens=True)


def test_rids_are_reported_per_prompt_and_per_sample(engine_for):
    engine = engine_for()
    outs = engine.generate(PROMPTS[:2], greedy(2), rid=["first", "second"])
    assert [o["meta_info"]["id"] for o in outs] == ["first", "second"]
    samples = engine.generate(PROMPTS[0], greedy(2, n=2), rid="x")
    assert [o["meta_info"]["id"] for o in samples] == ["x-0", "x-1"]


# max_new_tokens = 0 ------------------------------------------------------------------------


def test_max_new_tokens_zero_is_prefill_only_with_prompt_logprobs(engine_for):
    engine = engine_for()
    prompt_ids = engine.tokenizer.encode(PROMPTS[1])
    out = engine.generate(input_ids=prompt_ids, sampling_params={"max_new_tokens": 0},
                          return_logprob=True, logprob_start_len=0)
    assert out["text"] == ""
    assert out["output_ids"] == []
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["completion_tokens"] == 0
    assert meta["output_token_logprobs"] == []
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == prompt_ids
    assert entries[0][0] is None
    assert all(isinstance(e[0], float) and e[0] <= 0.0 for e in entries[1:])
    # The same numbers come back when the prompt is followed by generation.
    with_output = engine.generate(input_ids=prompt_ids, sampling_params=greedy(2),
                                  return_logprob=True, logprob_start_len=0)
    assert [e[0] for e in with_output["meta_info"]["input_token_logprobs"][1:]] == pytest.approx(
        [e[0] for e in entries[1:]], abs=1e-5
    )


# Stop tokens, EOS, min_new_tokens -------------------------------------------------------------


def test_stop_token_ids_stop_at_the_first_occurrence(engine_for):
    engine = engine_for()
    free = engine.generate(PROMPTS[0], greedy(24))["output_ids"]
    stop_id = free[3]
    first = free.index(stop_id)
    out = engine.generate(PROMPTS[0], greedy(24, stop_token_ids=[stop_id]))
    assert out["output_ids"] == free[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}


def test_eos_stops_generation_unless_ignore_eos(engine_for):
    engine = engine_for()
    eos = engine.tokenizer.eos_token_id
    force_eos = {"temperature": 0.0, "max_new_tokens": 6, "logit_bias": {str(eos): 100.0}}
    stopped = engine.generate(PROMPTS[0], force_eos)
    assert stopped["output_ids"] == [eos]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    assert stopped["text"] == ""  # the special token is skipped in the text
    ignored = engine.generate(PROMPTS[0], {**force_eos, "ignore_eos": True})
    assert ignored["output_ids"] == [eos] * 6
    assert ignored["meta_info"]["finish_reason"] == {"type": "length", "length": 6}


def test_ignore_eos_keeps_stop_token_ids_active(engine_for):
    engine = engine_for()
    params = greedy(6, logit_bias={"7": 100.0}, stop_token_ids=[7])
    out = engine.generate(PROMPTS[0], params)
    assert out["output_ids"] == [7]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 7}


@pytest.mark.parametrize("min_new_tokens", [1, 4])
@pytest.mark.parametrize("stop_kind", ["eos", "stop_token_ids"])
def test_min_new_tokens_delays_stopping(engine_for, min_new_tokens, stop_kind):
    engine = engine_for()
    token = engine.tokenizer.eos_token_id if stop_kind == "eos" else 7
    params = {"temperature": 0.0, "max_new_tokens": 12, "min_new_tokens": min_new_tokens,
              "logit_bias": {str(token): 100.0}}
    if stop_kind == "stop_token_ids":
        params.update(stop_token_ids=[token], ignore_eos=True)
    out = engine.generate(PROMPTS[0], params)
    ids = out["output_ids"]
    # Banned while fewer than min_new_tokens were produced, then the forced token stops it.
    assert token not in ids[:min_new_tokens]
    assert ids[min_new_tokens:] == [token]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": token}


def test_a_matched_stop_token_is_trimmed_from_the_text_unless_no_stop_trim(engine_for):
    engine = engine_for()
    token = engine.tokenizer.encode("d")[0]  # an ordinary, visible token
    params = greedy(6, logit_bias={str(token): 100.0}, stop_token_ids=[token])
    kept = engine.generate(PROMPTS[0], {**params, "no_stop_trim": True})
    assert kept["text"] == "d"
    trimmed = engine.generate(PROMPTS[0], params)
    assert trimmed["output_ids"] == [token]
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": token}
    assert trimmed["text"] == ""


# Stop strings and stop regexes -----------------------------------------------------------------

SAFE_CHAR = re.compile(r"[A-Za-z0-9 ]")


def pick_stop(text: str, size: int = 3) -> tuple[str, int]:
    """A clean substring of ``text`` from its middle, and where it first occurs."""
    for start in range(4, len(text) - size - 4):
        candidate = text[start : start + size]
        if all(SAFE_CHAR.match(c) for c in candidate) and text.find(candidate) == start:
            return candidate, start
    raise AssertionError(f"no clean {size}-character stop string in {text!r}")


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_stop_string_trims_the_text_before_it(engine_for, prompt):
    engine = engine_for()
    free = engine.generate(prompt, greedy(48))
    stop, start = pick_stop(free["text"])
    out = engine.generate(prompt, greedy(48, stop=stop))
    assert out["text"] == free["text"][:start]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # Generation ended at the token that completed the stop string.
    assert out["output_ids"] == free["output_ids"][: len(out["output_ids"])]
    assert len(out["output_ids"]) < len(free["output_ids"])
    kept = engine.generate(prompt, greedy(48, stop=[stop], no_stop_trim=True))
    assert kept["text"] == free["text"][: start + len(stop)]
    assert kept["text"].endswith(stop)
    assert kept["output_ids"] == out["output_ids"]


def test_the_earliest_of_several_stop_strings_wins(engine_for):
    engine = engine_for()
    free = engine.generate(PROMPTS[0], greedy(48))
    first, start = pick_stop(free["text"], size=2)
    later = free["text"][-4:]  # occurs after ``first`` (or not at all before the end)
    out = engine.generate(PROMPTS[0], greedy(48, stop=[later, first]))
    assert out["text"] == free["text"][:start]
    assert out["meta_info"]["finish_reason"]["matched"] == first


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_stop_regex_trims_the_text_before_the_match(engine_for, prompt):
    engine = engine_for()
    free = engine.generate(prompt, greedy(48))
    stop, _ = pick_stop(free["text"])
    pattern = re.escape(stop[0]) + "." + re.escape(stop[2])
    expected = re.search(pattern, free["text"])
    out = engine.generate(prompt, greedy(48, stop_regex=pattern))
    assert out["text"] == free["text"][: expected.start()]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": expected.group(0)}
    kept = engine.generate(prompt, greedy(48, stop_regex=[pattern], no_stop_trim=True))
    assert kept["text"] == free["text"][: expected.end()]


def test_a_special_token_stop_string_stops_generation(engine_for):
    engine = engine_for()
    im_end = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end not in engine.model_config.eos_token_ids
    params = greedy(6, logit_bias={str(im_end): 100.0}, stop="<|im_end|>")
    out = engine.generate(PROMPTS[0], params)
    assert out["output_ids"] == [im_end]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "<|im_end|>"}


# Streaming --------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_stream_chunks_are_cumulative_and_end_with_the_non_stream_result(engine_for, prompt):
    engine = engine_for()
    full = engine.generate(prompt, greedy(20))
    chunks = list(engine.generate(prompt, greedy(20), stream=True))
    assert len(chunks) >= 2
    last = chunks[-1]
    assert last["text"] == full["text"]
    assert last["output_ids"] == full["output_ids"]
    assert last["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]
    for chunk in chunks[:-1]:
        assert chunk["meta_info"]["finish_reason"] is None
        assert full["text"].startswith(chunk["text"])
        assert full["output_ids"][: len(chunk["output_ids"])] == chunk["output_ids"]
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(lengths)


def stop_across_a_chunk_boundary(engine, prompt: str) -> tuple[str, int] | None:
    """A clean 3-character stop whose first character ends one streamed chunk, so the
    chunk's text ends with the start of the stop string; and where it first occurs."""
    chunks = list(engine.generate(prompt, greedy(48), stream=True))
    text = chunks[-1]["text"]
    for chunk in chunks[:-1]:
        b = len(chunk["text"])
        stop = text[b - 1 : b + 2]
        if (b >= 3 and b + 4 <= len(text) and all(SAFE_CHAR.match(c) for c in stop)
                and text.find(stop) == b - 1):
            return stop, b - 1
    return None


def test_stream_holds_back_a_partial_stop_string(engine_for):
    engine = engine_for()
    found = {p: stop_across_a_chunk_boundary(engine, p) for p in PROMPTS}
    cases = {p: f for p, f in found.items() if f is not None}
    assert cases, "no prompt streamed a chunk ending with the start of a clean stop string"
    for prompt, (stop, start) in cases.items():
        full = engine.generate(prompt, greedy(48))["text"]
        chunks = list(engine.generate(prompt, greedy(48, stop=stop), stream=True))
        final = chunks[-1]
        assert final["text"] == full[:start]
        assert final["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        for chunk in chunks:
            assert final["text"].startswith(chunk["text"])


def test_stream_of_a_batch_tags_chunks_with_their_prompt_index(engine_for):
    engine = engine_for()
    expected = engine.generate(PROMPTS[:3], [greedy(n) for n in (3, 7, 5)])
    last: dict[int, dict] = {}
    for chunk in engine.generate(PROMPTS[:3], [greedy(n) for n in (3, 7, 5)], stream=True):
        index = chunk["index"]
        assert index not in last or last[index]["meta_info"]["finish_reason"] is None
        last[index] = chunk
    assert sorted(last) == [0, 1, 2]
    for index, out in enumerate(expected):
        assert last[index]["output_ids"] == out["output_ids"]
        assert last[index]["text"] == out["text"]


def test_closing_a_stream_early_frees_its_kv(engine_for):
    engine = engine_for()
    stream = engine.generate(PROMPTS[:2], greedy(40), stream=True)
    for seen, _ in enumerate(stream, start=1):
        if seen == 3:
            break
    stream.close()
    assert_engine_idle(engine)
    # The engine serves the next request normally.
    assert engine.generate(PROMPTS[0], greedy(4))["meta_info"]["completion_tokens"] == 4


def test_a_stream_that_is_never_started_queues_nothing(engine_for):
    engine = engine_for()
    stream = engine.generate(PROMPTS[0], greedy(4), stream=True)
    stream.close()
    assert_engine_idle(engine)


def test_stream_of_a_prefill_only_request_yields_one_final_chunk(engine_for):
    chunks = list(engine_for().generate(PROMPTS[0], {"max_new_tokens": 0}, stream=True))
    assert len(chunks) == 1
    assert chunks[0]["text"] == "" and chunks[0]["output_ids"] == []
    assert chunks[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_generate_while_a_stream_is_open_serves_both(engine_for):
    engine = engine_for()
    expected_stream = engine.generate(PROMPTS[0], greedy(12))
    expected_inner = engine.generate(PROMPTS[2], greedy(5))
    stream = engine.generate(PROMPTS[0], greedy(12), stream=True)
    first = next(stream)
    inner = engine.generate(PROMPTS[2], greedy(5))
    rest = list(stream)
    assert inner["output_ids"] == expected_inner["output_ids"]
    assert (rest or [first])[-1]["output_ids"] == expected_stream["output_ids"]
    assert (rest or [first])[-1]["text"] == expected_stream["text"]


# n and sampling_seed ------------------------------------------------------------------------------


def test_n_samples_return_a_list(engine_for):
    engine = engine_for()
    outs = engine.generate(PROMPTS[0], sampled(11, 12, n=2))
    assert isinstance(outs, list) and len(outs) == 2
    assert all(o["meta_info"]["completion_tokens"] == 12 for o in outs)
    assert outs[0]["output_ids"] != outs[1]["output_ids"]
    again = engine.generate(PROMPTS[0], sampled(11, 12, n=2))
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]


def test_n_greedy_samples_are_identical(engine_for):
    outs = engine_for().generate(PROMPTS[0], greedy(12, n=2))
    assert len(outs) == 2
    assert outs[0]["output_ids"] == outs[1]["output_ids"]
    assert outs[0]["text"] == outs[1]["text"]


def test_n_applies_per_prompt_in_a_batch(engine_for):
    outs = engine_for().generate(PROMPTS[:2], [greedy(3, n=2), greedy(4, n=3)])
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [3, 3, 4, 4, 4]


def test_same_sampling_seed_gives_the_same_tokens(engine_for):
    engine = engine_for()
    first = engine.generate(PROMPTS[1], sampled(42, 16))
    engine.generate(PROMPTS, sampled(None, 8))  # advances the engine's own generator
    second = engine.generate(PROMPTS[1], sampled(42, 16))
    other = engine.generate(PROMPTS[1], sampled(43, 16))
    assert first["output_ids"] == second["output_ids"]
    assert first["output_ids"] != other["output_ids"]


def test_seeded_request_gives_the_same_tokens_alone_and_in_a_batch(engine_for):
    engine = engine_for()
    alone = engine.generate(PROMPTS[1], sampled(7, 16))
    batch = engine.generate(
        [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3]],
        [sampled(None), sampled(7, 16), greedy(20), sampled(99, 4)],
    )
    assert batch[1]["output_ids"] == alone["output_ids"]
