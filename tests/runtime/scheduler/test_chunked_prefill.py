"""Chunked prefill: a prompt longer than ``chunked_prefill_size`` is computed chunk by chunk,
and ``max_prefill_tokens`` caps the new prompt tokens of one step. Neither may change a
single logprob or token."""

from __future__ import annotations

import random

import pytest
import torch
from runtime_checks import assert_pool_idle, run_to_completion, scheduler_req
from tiny_models import reference_prompt_logprobs
from workloads import greedy, random_ids

from radixlm.kernels.forward_batch import ForwardMode
from radixlm.runtime.model_executor.thread_policy import ThreadPolicy
from radixlm.runtime.scheduler.prefill_pace import ALONE_TARGET_FACTOR

CHUNK = 32
LONG = 10 * CHUNK  # the tiny model's context is 512


def record_extends(scheduler, monkeypatch) -> list[list[int]]:
    """Every EXTEND forward pass from now on, as its per-request new-token counts."""
    extends: list[list[int]] = []
    forward = scheduler.runner.forward

    def recording_forward(batch):
        if batch.mode == ForwardMode.EXTEND:
            extends.append(list(batch.extend_seq_lens_list))
        return forward(batch)

    monkeypatch.setattr(scheduler.runner, "forward", recording_forward)
    return extends


def run(scheduler, prompts, params, **fields) -> list:
    """Runs requests straight on an in-process scheduler; returns its finished ``Req``s."""
    reqs = [scheduler_req(scheduler, p, s, **fields) for p, s in zip(prompts, params)]
    run_to_completion(scheduler, reqs)
    return reqs


def values(entries: list) -> torch.Tensor:
    return torch.tensor([e[0] for e in entries if e[0] is not None])


def assert_same_results(got, want) -> None:
    assert got.output_ids == want.output_ids
    for key in ("input_token_logprobs", "output_token_logprobs"):
        ours, theirs = getattr(got, key), getattr(want, key)
        assert [e[1] for e in ours] == [e[1] for e in theirs], key
        torch.testing.assert_close(values(ours), values(theirs), atol=1e-5, rtol=0)


def test_the_engine_prefills_a_long_prompt_in_chunks_with_the_same_results(engine_for):
    chunked = engine_for(chunked_prefill_size=CHUNK)
    assert chunked.get_server_info()["chunked_prefill_size"] == CHUNK
    whole = engine_for()  # the default chunk (1024) exceeds the context: never chunked
    ids = random_ids(1, LONG)
    kwargs = dict(input_ids=ids, sampling_params=greedy(16), return_logprob=True,
                  logprob_start_len=0)
    want = whole.generate(**kwargs)
    before = chunked.get_server_info()["stats"]["extend_steps"]
    got = chunked.generate(**kwargs)
    assert chunked.get_server_info()["stats"]["extend_steps"] - before >= LONG // CHUNK
    assert got["output_ids"] == want["output_ids"]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        assert len(got["meta_info"][key]) == len(want["meta_info"][key])
        torch.testing.assert_close(values(got["meta_info"][key]), values(want["meta_info"][key]),
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize(("chunk", "page_size"), [(CHUNK, 1), (CHUNK, 4), (30, 4)])
def test_a_prompt_ten_chunks_long_gives_the_unchunked_logprobs_and_tokens(
    scheduler_for, tiny_model_dir, monkeypatch, chunk, page_size
):
    chunked = scheduler_for(chunked_prefill_size=chunk, page_size=page_size)
    whole = scheduler_for(chunked_prefill_size=None, page_size=page_size)
    ids = random_ids(1, LONG)
    fields = dict(return_logprob=True, logprob_start=0)
    [want] = run(whole, [ids], [greedy(16)], **fields)
    extends = record_extends(chunked, monkeypatch)
    [got] = run(chunked, [ids], [greedy(16)], **fields)
    # It really was chunked: at least ten passes, none over the chunk size.
    assert len(extends) >= LONG // chunk
    assert max(n for step in extends for n in step) <= chunk
    assert sum(n for step in extends for n in step) == LONG
    assert len(got.input_token_logprobs) == LONG
    assert_same_results(got, want)
    # And both agree with transformers over the whole prompt.
    reference = reference_prompt_logprobs(tiny_model_dir(), ids)
    torch.testing.assert_close(values(got.input_token_logprobs), reference, atol=1e-4, rtol=0)


def test_an_unchunked_scheduler_prefills_a_long_prompt_in_one_pass(scheduler_for, monkeypatch):
    whole = scheduler_for(chunked_prefill_size=None)
    extends = record_extends(whole, monkeypatch)
    run(whole, [random_ids(2, LONG)], [greedy(2)], return_logprob=True, logprob_start=0)
    assert extends == [[LONG]]


@pytest.mark.parametrize("page_size", [1, 4])
def test_several_long_prompts_chunked_in_one_batch_match_unchunked(
    scheduler_for, monkeypatch, page_size
):
    chunked = scheduler_for(chunked_prefill_size=CHUNK, page_size=page_size)
    whole = scheduler_for(chunked_prefill_size=None, page_size=page_size)
    chunked.memory.flush()
    prompts = [random_ids(10 + i, n) for i, n in enumerate((300, 7, 190, 65, 257, 33, 120))]
    params = [greedy(n) for n in (12, 20, 5, 16, 9, 1, 30)]
    fields = dict(return_logprob=True, logprob_start=0)
    want = run(whole, prompts, params, **fields)
    extends = record_extends(chunked, monkeypatch)
    got = run(chunked, prompts, params, **fields)
    assert max(n for step in extends for n in step) <= CHUNK
    for ours, theirs in zip(got, want):
        assert_same_results(ours, theirs)


@pytest.mark.parametrize("page_size", [1, 4])
def test_logprobs_starting_inside_a_later_chunk_match_unchunked(scheduler_for, page_size):
    chunked = scheduler_for(chunked_prefill_size=CHUNK, page_size=page_size)
    whole = scheduler_for(chunked_prefill_size=None, page_size=page_size)
    chunked.memory.flush()
    ids = random_ids(3, LONG)
    start = 6 * CHUNK + 11  # inside the seventh chunk
    [full] = run(whole, [ids], [greedy(16)], return_logprob=True, logprob_start=0)
    for _ in range(2):  # cold, then with the prompt's chunks cached by the first run
        [got] = run(chunked, [ids], [greedy(16)], return_logprob=True, logprob_start=start,
                    top_logprobs_num=3)
        assert [e[1] for e in got.input_token_logprobs] == ids[start + 1 :]
        torch.testing.assert_close(values(got.input_token_logprobs),
                                   values(full.input_token_logprobs)[start:], atol=1e-5, rtol=0)
        assert len(got.input_top_logprobs) == len(got.input_token_logprobs)
        assert got.output_ids == full.output_ids
    assert got.cached_tokens == start - start % page_size


def test_finished_chunks_are_cached_for_the_next_request(scheduler_for):
    chunked = scheduler_for(chunked_prefill_size=CHUNK)
    chunked.memory.flush()
    ids = random_ids(4, LONG)
    run(chunked, [ids], [greedy(1)])
    [sibling] = run(chunked, [ids[:200] + random_ids(5, 40)], [greedy(1)])
    assert sibling.cached_tokens == 200


def test_a_small_max_prefill_tokens_spreads_many_prompts_over_steps(
    scheduler_for, monkeypatch
):
    limited = scheduler_for(max_prefill_tokens=64)
    reference = scheduler_for()
    limited.memory.flush()
    rng = random.Random(6)
    prompts = [random_ids(100 + i, rng.randint(5, 30)) for i in range(40)]
    params = [greedy(rng.randint(1, 12)) for _ in prompts]
    want = run(reference, prompts, params)
    extends = record_extends(limited, monkeypatch)
    got = run(limited, prompts, params)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert all(sum(step) <= 64 for step in extends), extends
    assert len(extends) >= sum(len(p) for p in prompts) // 64


def test_aborting_a_request_in_the_middle_of_its_chunks_frees_them(scheduler_for):
    scheduler = scheduler_for(chunked_prefill_size=CHUNK)
    scheduler.memory.flush()
    short = scheduler_req(scheduler, random_ids(7, 10), greedy(20))
    long = scheduler_req(scheduler, random_ids(8, LONG), greedy(20))
    scheduler.add_request(short)
    scheduler.add_request(long)
    scheduler.step()
    scheduler.step()
    assert long.kv_len > 0 and long.kv_len < LONG and not long.output_ids  # mid-prefill
    scheduler.abort(long)
    assert long.finish_reason["type"] == "abort"
    for _ in range(100):  # it is queued already
        if short.finished:
            break
        scheduler.step()
    assert short.finish_reason == {"type": "length", "length": 20}
    # Its finished chunks may stay cached, unlocked; nothing else is held.
    assert_pool_idle(scheduler.server_info())


def test_a_short_prompt_is_prefilled_between_the_chunks_of_a_long_one(scheduler_for, monkeypatch):
    """A long prompt's chunks used to take every step until it was done, so a one-token
    request behind it waited for the whole prefill; now the prompts that fit whole in half a
    chunk run in the next step, and the long prompt's chunk in the one after."""
    scheduler = scheduler_for(chunked_prefill_size=CHUNK)
    reference = scheduler_for(chunked_prefill_size=None)
    scheduler.memory.flush()
    long_ids, short_ids = random_ids(11, LONG), random_ids(12, 10)
    want = run(reference, [long_ids, short_ids], [greedy(4), greedy(1)])
    extends = record_extends(scheduler, monkeypatch)
    long = scheduler_req(scheduler, long_ids, greedy(4))
    short = scheduler_req(scheduler, short_ids, greedy(1))
    scheduler.add_request(long)
    scheduler.step()
    scheduler.add_request(short)
    scheduler.step()
    assert short.finished and short.output_ids == want[1].output_ids
    scheduler.step()
    assert 0 < long.kv_len < LONG  # still being prefilled
    assert extends == [[CHUNK], [10], [CHUNK]]  # the short prompt alone, then the next chunk
    for _ in range(100):
        if long.finished:
            break
        scheduler.step()
    assert long.output_ids == want[0].output_ids
    assert all(sum(step) <= CHUNK + CHUNK // 2 for step in extends)


def test_running_requests_decode_between_the_chunks_of_a_long_prompt(scheduler_for):
    """Prefill went first at every step, so a request already decoding stalled for all of a
    long prompt's chunks; now it gets a token after each chunk."""
    scheduler = scheduler_for(chunked_prefill_size=CHUNK)
    scheduler.memory.flush()
    running = scheduler_req(scheduler, random_ids(13, 10), greedy(40))
    scheduler.add_request(running)
    scheduler.step()
    long = scheduler_req(scheduler, random_ids(14, LONG), greedy(2))
    scheduler.add_request(long)
    tokens_after_chunks = []
    while not long.output_ids:
        before = long.kv_len
        scheduler.step()
        if long.kv_len > before and long.kv_len < LONG:
            tokens_after_chunks.append(len(running.output_ids))
    assert len(tokens_after_chunks) == LONG // CHUNK - 1
    # Between two chunks the running request decoded (with overlap: one step behind).
    assert all(b > a for a, b in zip(tokens_after_chunks, tokens_after_chunks[1:]))
    for _ in range(200):
        if running.finished and long.finished:
            break
        scheduler.step()
    assert running.finish_reason == {"type": "length", "length": 40}
    assert_pool_idle(scheduler.server_info())


def test_prompt_logprobs_of_a_long_unchunked_prefill_go_through_the_lm_head_in_slices(
    scheduler_for, monkeypatch
):
    """A step owing many prompt logprobs never holds rows x vocabulary logits at once: the
    LM head sees at most ``PROMPT_LOGPROB_SLICE_ROWS`` rows per call, and the sliced
    results equal those of one pass (the whole prompt fits a single slice here)."""
    from radixlm.runtime.scheduler import sampling_step

    whole = scheduler_for(chunked_prefill_size=None)
    prompts = [random_ids(20, 300), random_ids(21, 90)]
    fields = dict(return_logprob=True, logprob_start=0, top_logprobs_num=2)
    monkeypatch.setattr(sampling_step, "PROMPT_LOGPROB_SLICE_ROWS", 1024)
    want = run(whole, prompts, [greedy(4), greedy(4)], **fields)
    monkeypatch.setattr(sampling_step, "PROMPT_LOGPROB_SLICE_ROWS", 64)
    head_rows: list[int] = []
    processor = whole.sampling_step
    compute = processor.compute_logits

    def recording_compute(hidden):
        head_rows.append(hidden.shape[0])
        return compute(hidden)

    monkeypatch.setattr(processor, "compute_logits", recording_compute)
    got = run(whole, prompts, [greedy(4), greedy(4)], **fields)
    assert max(head_rows) <= 64
    assert sum(head_rows) >= 300 + 90 - 2  # every owed row went through the head
    for ours, theirs in zip(got, want):
        assert_same_results(ours, theirs)
        tops = [(ours_row, theirs_row) for ours_row, theirs_row
                in zip(ours.input_top_logprobs[1:], theirs.input_top_logprobs[1:], strict=True)]
        assert [[e[1] for e in a] for a, _ in tops] == [[e[1] for e in b] for _, b in tops]
        torch.testing.assert_close(torch.tensor([[e[0] for e in a] for a, _ in tops]),
                                   torch.tensor([[e[0] for e in b] for _, b in tops]),
                                   atol=1e-5, rtol=0)


def test_a_prompt_nobody_waits_behind_is_cut_into_longer_chunks(scheduler_for, monkeypatch):
    """Chunks are sized by the measured speed to take ``chunked_prefill_step_ms``, or
    ALONE_TARGET_FACTOR times that when no other request runs or waits."""
    scheduler = scheduler_for(chunked_prefill_size=LONG, chunked_prefill_step_ms=250)
    pace = scheduler.prefill_pace
    monkeypatch.setattr(pace, "seconds_per_token", 0.25 / CHUNK)  # CHUNK tokens take 250 ms
    monkeypatch.setattr(pace, "observe", lambda tokens, seconds: None)  # and keep doing so
    extends = record_extends(scheduler, monkeypatch)
    run(scheduler, [random_ids(3, LONG)], [greedy(1)])
    lone = CHUNK * ALONE_TARGET_FACTOR
    assert extends == [[lone]] * (LONG // lone) + [[LONG % lone]] * (LONG % lone > 0)
    extends.clear()
    run(scheduler, [random_ids(4, LONG), random_ids(5, LONG)], [greedy(1)] * 2)
    # While the second prompt waits, the first one's chunks keep to the target; alone
    # again, the second one's grow.
    assert all(n == CHUNK for step in extends[: LONG // CHUNK] for n in step)
    assert [lone] in extends[LONG // CHUNK :]


def test_a_pass_on_a_thread_count_under_trial_does_not_set_the_pace(scheduler_for, monkeypatch):
    """The CPU thread policy tries each thread count on a size of pass it has not seen (one
    thread can take twice as long): such passes must not make the pace cut the next prompts
    shorter. The prompt passes that ran on the policy's choice, and only they, are timed
    (the first one too: it made its count the choice)."""

    class OneThreadSlower(ThreadPolicy):  # the tiny model's own times would decide nothing
        def record(self, num_tokens: int, threads: int, seconds: float,
                   cpu_seconds: float | None = None) -> None:
            # Without CPU times large passes try every count too (as with a neighbour).
            super().record(num_tokens, threads, 2.0 if threads == 1 else 1.0)

    scheduler = scheduler_for(chunked_prefill_size=LONG, chunked_prefill_step_ms=250)
    monkeypatch.setattr(scheduler.runner, "thread_policy", OneThreadSlower(max_threads=2))
    observed: list[int] = []
    monkeypatch.setattr(scheduler.prefill_pace, "observe",
                        lambda tokens, seconds: observed.append(tokens))
    trials: list[bool] = []
    forward = scheduler.runner.forward

    def noting_forward(batch):
        hidden = forward(batch)
        if batch.mode == ForwardMode.EXTEND:
            trials.append(scheduler.runner.last_pass_was_trial)
        return hidden

    monkeypatch.setattr(scheduler.runner, "forward", noting_forward)
    for seed in range(4):
        run(scheduler, [random_ids(20 + seed, 100)], [greedy(1)])
    assert trials == [False, True, False, False]  # all threads tried, then one, then chosen
    assert observed == [100, 100, 100]


def test_without_adaptive_timing_nothing_is_chosen_by_the_clock(scheduler_for):
    """``disable_adaptive_timing``: chunks cut by ``chunked_prefill_size`` alone whatever the
    passes took, and every pass on the same threads (no thread policy), so a run repeats."""
    size = 1024
    scheduler = scheduler_for(disable_adaptive_timing=True, chunked_prefill_size=size)
    assert scheduler.runner.thread_policy is None
    pace = scheduler.prefill_pace
    pace.observe(size, 30.0)  # a very slow pass would shorten a paced chunk
    assert pace.chunk_tokens() == pace.chunk_tokens(alone=True) == size
    paced = scheduler_for(chunked_prefill_size=size)
    assert paced.runner.thread_policy is not None
    paced.prefill_pace.observe(size, 30.0)
    assert paced.prefill_pace.chunk_tokens() < size  # (the test can fail)
