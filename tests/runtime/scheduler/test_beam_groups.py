"""Beam search through the Engine (``use_beam_search`` with ``n`` the width), checked against
transformers' ``generate(num_beams=k, num_return_sequences=k, do_sample=False)`` on the same
weights: the same k hypotheses, best first, token for token (EOS included when one ended on
it), ``beam_score`` equal to transformers' ``sequences_scores``, and ``cumulative_logprob`` the
hypothesis's summed logprobs. Also: beams batched with ordinary requests, a prefix-cache hit,
the KV a search holds at its peak (the prompt once, not once per beam), and an abort by one
member's rid through the Engine's processes.

The variants that change how the scheduler runs the beams (pages, chunked prefill, overlap,
retraction) and the step-by-step KV accounting are in test_beam_search_scheduling.py."""

from __future__ import annotations

import threading
import time

import pytest
from beam_reference import (
    SETTINGS,
    beam,
    check_beams,
    frequent_stop_ids,
    reference_beams,
)
from runtime_checks import assert_engine_idle
from workloads import greedy, random_ids

# One CPU thread: an output then depends on its batch alone (a thread count chosen by timing
# may change a logprob's last bits, and beam search ranks candidates by them).
BASE = {"num_threads": 1}
NEW_TOKENS = 16


def as_list(out) -> list[dict]:
    return out if isinstance(out, list) else [out]


def eos_of(engine, stop_token_ids: list[int] | None = None) -> list[int]:
    """What radixlm ends a hypothesis on: the request's stop tokens and the model's EOS."""
    return list(stop_token_ids or []) + [engine.tokenizer.eos_token_id]


def run_and_check(engine, directory, ids, width, length_penalty, early_stopping,
                  stop_token_ids=None, max_new_tokens=NEW_TOKENS) -> int:
    """One beam search through ``engine``, compared with transformers; returns how many of
    its hypotheses ended on an EOS token."""
    eos = eos_of(engine, stop_token_ids)
    extra = {"stop_token_ids": stop_token_ids} if stop_token_ids else {}
    out = engine.generate(input_ids=ids, sampling_params=beam(
        width, max_new_tokens, length_penalty, early_stopping, **extra))
    if width == 1:
        assert isinstance(out, dict), "n=1 returns one output, as without beam search"
    else:
        assert isinstance(out, list) and len(out) == width
    expected = reference_beams(directory, ids, width, max_new_tokens, length_penalty,
                               early_stopping, eos)
    return check_beams(as_list(out), expected, length_penalty, eos, max_new_tokens,
                       directory, ids)


SLOW = pytest.mark.slow  # (the widths between: CI's last stage)


@pytest.mark.parametrize("width", [1, pytest.param(2, marks=SLOW), pytest.param(4, marks=SLOW), 8])
@pytest.mark.parametrize(("length_penalty", "early_stopping"), SETTINGS,
                         ids=[f"lp{lp}-{es}" for lp, es in SETTINGS])
def test_beams_equal_transformers_for_every_width_and_setting(
    engine_for, tiny_model_dir, width, length_penalty, early_stopping
):
    engine = engine_for(**BASE)
    ids = random_ids(100 + width, 12)
    run_and_check(engine, tiny_model_dir(), ids, width, length_penalty, early_stopping)


@pytest.mark.parametrize("width", [pytest.param(2, marks=SLOW), pytest.param(4, marks=SLOW), 8])
@pytest.mark.parametrize(("length_penalty", "early_stopping"),
                         [(1.0, False), (2.0, True), (0.5, "never"), (-0.5, False)],
                         ids=["lp1-False", "lp2-True", "lp0.5-never", "lp-0.5-False"])
def test_hypotheses_that_end_on_stop_tokens_equal_transformers(
    engine_for, tiny_model_dir, width, length_penalty, early_stopping
):
    """transformers is given the request's stop tokens and the model's EOS as its EOS ids."""
    engine = engine_for(**BASE)
    directory = tiny_model_dir()
    ids = random_ids(200 + width, 12)
    stops = frequent_stop_ids(directory, ids, width, NEW_TOKENS, length_penalty, early_stopping,
                              engine.tokenizer.eos_token_id)
    ended = run_and_check(engine, directory, ids, width, length_penalty, early_stopping, stops)
    assert ended > 0, "no hypothesis ended on a stop token: the test checked no EOS handling"


@pytest.mark.parametrize(("length_penalty", "early_stopping"),
                         [(1.0, False), (2.0, True), (0.5, "never")],
                         ids=["lp1-False", "lp2-True", "lp0.5-never"])
def test_width_one_is_transformers_greedy_search_also_when_it_ends_on_a_stop_token(
    engine_for, tiny_model_dir, length_penalty, early_stopping
):
    """transformers runs ``num_beams=1`` as greedy search: the first EOS ends the output,
    whatever the length penalty or ``early_stopping`` say."""
    engine = engine_for(**BASE)
    directory = tiny_model_dir()
    ids = random_ids(300, 12)
    stops = frequent_stop_ids(directory, ids, 1, NEW_TOKENS, length_penalty, early_stopping,
                              engine.tokenizer.eos_token_id)
    assert run_and_check(engine, directory, ids, 1, length_penalty, early_stopping,
                         stops) == 1


@SLOW  # (an engine each; test_beam_search_scheduling runs them in-process too)
@pytest.mark.parametrize(("architecture", "kv"), [
    ("Qwen3ForCausalLM", "gqa"), ("MixtralForCausalLM", "gqa"), ("DeepseekV2ForCausalLM", "mha"),
])
def test_other_architectures_equal_transformers(engine_for, tiny_model_dir, architecture, kv):
    """Qwen3 (q/k norms), Mixtral (routed experts) and DeepSeek-V2 (MLA: one latent per
    token shared by the heads), with and without stop tokens. (DeepSeek-V2 as "mha": with
    fewer KV heads than heads in its config, transformers' MLA repeats its per-head keys
    and fails on a batch of more than one sequence.)"""
    engine = engine_for(architecture, kv, **BASE)
    directory = tiny_model_dir(architecture, kv)
    ids = random_ids(400, 12)
    run_and_check(engine, directory, ids, 4, 1.0, False)
    stops = frequent_stop_ids(directory, ids, 4, NEW_TOKENS, 2.0, True,
                              engine.tokenizer.eos_token_id)
    assert run_and_check(engine, directory, ids, 4, 2.0, True, stops) > 0


def test_beams_batched_with_greedy_requests_leave_both_unchanged(engine_for, tiny_model_dir):
    """One generate call with greedy requests and two beam searches between them: the greedy
    outputs equal their outputs alone, the beams equal transformers'. Outputs come flat, the
    beams of a request together and best first, in the order of the prompts."""
    engine = engine_for(**BASE)
    directory = tiny_model_dir()
    prompts = [random_ids(500 + i, 10 + 7 * i) for i in range(4)]
    greedy_params = [greedy(24), greedy(9)]
    alone = [engine.generate(input_ids=prompts[i], sampling_params=p)["output_ids"]
             for i, p in zip((0, 2), greedy_params)]
    stops = frequent_stop_ids(directory, prompts[3], 2, NEW_TOKENS, 2.0, True,
                              engine.tokenizer.eos_token_id)
    params = [greedy_params[0], beam(4, NEW_TOKENS), greedy_params[1],
              beam(2, NEW_TOKENS, 2.0, True, stop_token_ids=stops)]
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert len(outs) == 1 + 4 + 1 + 2
    assert outs[0]["output_ids"] == alone[0]
    assert outs[5]["output_ids"] == alone[1]
    eos = eos_of(engine)
    check_beams(outs[1:5], reference_beams(directory, prompts[1], 4, NEW_TOKENS, 1.0, False,
                                           eos), 1.0, eos, NEW_TOKENS)
    eos = eos_of(engine, stops)
    check_beams(outs[6:8], reference_beams(directory, prompts[3], 2, NEW_TOKENS, 2.0, True,
                                           eos), 2.0, eos, NEW_TOKENS)


def test_a_repeated_beam_search_hits_the_prefix_cache_and_returns_the_same_beams(
    engine_for, tiny_model_dir
):
    engine = engine_for(**BASE)
    engine.flush_cache()
    ids = random_ids(600, 40)
    params = beam(4, NEW_TOKENS, 0.0, "never")
    first = engine.generate(input_ids=ids, sampling_params=params)
    again = engine.generate(input_ids=ids, sampling_params=params)
    # The prompt is prefilled once, for the search: every output reports its cache hit.
    assert all(out["meta_info"]["cached_tokens"] == len(ids) - 1 for out in again)
    assert first[0]["meta_info"]["cached_tokens"] == 0
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in first]
    assert [o["meta_info"]["beam_score"] for o in again] == pytest.approx(
        [o["meta_info"]["beam_score"] for o in first], abs=1e-4)
    eos = eos_of(engine)
    check_beams(again, reference_beams(tiny_model_dir(), ids, 4, NEW_TOKENS, 0.0, "never",
                                       eos), 0.0, eos, NEW_TOKENS)


def test_peak_kv_tokens_counts_the_prompt_once_not_once_per_beam(engine_for):
    """Eight beams over a 256-token prompt hold the prompt once and at most each beam's own
    tokens: far below the 8 x (prompt + output) slots of one KV cache per beam. A flush sets
    the peak back to what the pool holds then (nothing)."""
    engine = engine_for(**BASE)
    engine.flush_cache()
    assert engine.get_server_info()["peak_kv_tokens"] == 0
    prompt, width, new = 256, 8, NEW_TOKENS
    outs = engine.generate(input_ids=random_ids(700, prompt),
                           sampling_params=beam(width, new, 1.0, "never"))
    longest = max(len(o["output_ids"]) for o in outs)
    peak = engine.get_server_info()["peak_kv_tokens"]
    # At least the prompt and one beam's tokens but the last; at most the prompt once, each
    # beam's tokens, and one step queued ahead (overlap scheduling).
    assert prompt + longest - 1 <= peak <= prompt + width * (new + 1), peak
    engine.flush_cache()
    assert engine.get_server_info()["peak_kv_tokens"] == 0


def test_the_engine_aborts_a_running_search_by_one_member_s_rid(engine_for):
    """Through the processes: a long search is aborted by the rid of its third member; the
    caller gets all four outputs, ended by the abort, and the engine is idle."""
    engine = engine_for(**BASE)
    results = {}

    def run() -> None:
        results["outs"] = engine.generate(input_ids=random_ids(1202, 30), rid="long-beams",
                                          sampling_params=beam(4, 400, ignore_eos=True))

    caller = threading.Thread(target=run)
    caller.start()
    deadline = time.monotonic() + 30
    while engine.get_server_info()["num_running"] < 4:
        assert time.monotonic() < deadline, "the search never started decoding"
        time.sleep(0.02)
    engine.abort("long-beams-2")
    caller.join(timeout=30)
    assert not caller.is_alive()
    outs = results["outs"]
    assert [o["meta_info"]["id"] for o in outs] == [f"long-beams-{j}" for j in range(4)]
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
    assert_engine_idle(engine)
