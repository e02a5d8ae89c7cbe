"""Scheduling over the KV pool, end to end: paged pools, pools too small for every request at
once (admit what fits, queue the rest), requests that can never fit, and prefix-cache hits."""

from __future__ import annotations

import pytest
from runtime_checks import assert_engine_idle, run_to_completion, scheduler_req
from workloads import LONG_TEXT, greedy

import radixlm


def long_prompts(engine: radixlm.Engine, count: int, base_len: int) -> list[list[int]]:
    """``count`` different prompts of about ``base_len`` tokens (lengths differ by one)."""
    ids = engine.tokenizer.encode(LONG_TEXT)
    assert len(ids) >= base_len + 2 * count
    return [ids[i : i + base_len + i % 3] for i in range(count)]


@pytest.fixture
def fresh_engine(tiny_model_dir):
    """A new engine per call (an empty prefix cache), checked idle after the test."""
    made: list[radixlm.Engine] = []

    def build(**options) -> radixlm.Engine:
        options = {"dtype": "float32", **options}
        made.append(radixlm.Engine(str(tiny_model_dir()), **options))
        return made[-1]

    yield build
    for engine in made:
        assert_engine_idle(engine)


@pytest.mark.parametrize("page_size", [pytest.param(4, marks=pytest.mark.slow), 16])
def test_paged_pool_gives_the_same_greedy_tokens(engine_for, page_size):
    reference = engine_for()
    paged = engine_for(page_size=page_size)
    ids = [reference.tokenizer.encode(LONG_TEXT)[: n] for n in (1, 3, 4, 5, 15, 16, 17, 33)]
    expected = reference.generate(input_ids=ids, sampling_params=greedy(21))
    got = paged.generate(input_ids=ids, sampling_params=greedy(21))
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in expected]
    assert_engine_idle(paged)


def test_more_requests_than_request_rows_queue_and_all_complete(engine_for):
    reference = engine_for()
    narrow = engine_for(max_running_requests=2)
    ids = long_prompts(reference, 5, 10)
    expected = reference.generate(input_ids=ids, sampling_params=greedy(10))
    got = narrow.generate(input_ids=ids, sampling_params=greedy(10))
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in expected]


@pytest.mark.parametrize("disable_radix_cache",
                         [False, pytest.param(True, marks=pytest.mark.slow)])
def test_requests_beyond_the_pool_queue_and_all_complete(engine_for, fresh_engine,
                                                         disable_radix_cache):
    small = fresh_engine(max_total_tokens=256, disable_radix_cache=disable_radix_cache)
    ids = long_prompts(small, 8, 40)
    assert sum(len(i) + 32 for i in ids) > 2 * small.max_total_tokens
    expected = engine_for().generate(input_ids=ids, sampling_params=greedy(32))
    got = small.generate(input_ids=ids, sampling_params=greedy(32))
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in expected]
    assert all(o["meta_info"]["completion_tokens"] == 32 for o in got)


def test_streams_beyond_the_pool_queue_and_all_complete(engine_for, fresh_engine):
    small = fresh_engine(max_total_tokens=256)
    ids = long_prompts(small, 6, 40)
    expected = engine_for().generate(input_ids=ids, sampling_params=greedy(32))
    final = {}
    for chunk in small.generate(input_ids=ids, sampling_params=greedy(32), stream=True):
        final[chunk["index"]] = chunk["output_ids"]
    assert [final[i] for i in range(6)] == [o["output_ids"] for o in expected]


def test_request_that_can_never_fit_the_pool_is_refused(fresh_engine):
    small = fresh_engine(max_total_tokens=256)
    ids = small.tokenizer.encode(LONG_TEXT)[:200]
    with pytest.raises(ValueError, match="max_new_tokens"):
        small.generate(input_ids=ids, sampling_params=greedy(100))
    # Exactly the pool's size fits.
    out = small.generate(input_ids=ids, sampling_params=greedy(56))
    assert out["meta_info"]["completion_tokens"] == 56


def test_request_filling_a_paged_pool_completes(scheduler_for, engine_for):
    scheduler = scheduler_for(page_size=4, max_total_tokens=64)
    ids = engine_for().tokenizer.encode(LONG_TEXT)[:10]
    # 10 + 54 = 64 slots = 16 whole pages: exactly the pool. A wrong page reservation
    # would never admit it; run_to_completion fails instead of hanging.
    req = scheduler_req(scheduler, ids, greedy(54))
    run_to_completion(scheduler, [req], max_steps=200)
    assert len(req.output_ids) == 54


# Prefix cache ------------------------------------------------------------------------------------


def test_a_repeated_prompt_is_served_from_the_cache_with_the_same_results(fresh_engine):
    engine = fresh_engine(max_total_tokens=2048)
    ids = engine.tokenizer.encode(LONG_TEXT)[:30]
    kwargs = dict(input_ids=ids, sampling_params=greedy(8), return_logprob=True,
                  logprob_start_len=0)
    first = engine.generate(**kwargs)
    again = engine.generate(**kwargs)
    assert first["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] == 0  # capped at logprob_start_len = 0
    plain = engine.generate(input_ids=ids, sampling_params=greedy(8))
    assert plain["meta_info"]["cached_tokens"] == len(ids) - 1  # capped at prompt length - 1
    assert plain["output_ids"] == first["output_ids"] == again["output_ids"]
    capped = engine.generate(input_ids=ids, sampling_params=greedy(8), return_logprob=True,
                             logprob_start_len=12)
    assert capped["meta_info"]["cached_tokens"] == 12
    assert [e[0] for e in capped["meta_info"]["input_token_logprobs"]] == pytest.approx(
        [e[0] for e in first["meta_info"]["input_token_logprobs"][13:]], abs=1e-5
    )


def test_a_waiting_request_on_a_cached_prefix_runs_once_the_pool_frees(engine_for, fresh_engine):
    """Regression: the waiting request's prefix (a whole cached leaf) is locked and unlocked
    each step it does not fit; the leaf must stay evictable and matchable."""
    engine = fresh_engine(max_total_tokens=256)
    ids = engine.tokenizer.encode(LONG_TEXT)
    cached, extends_it, big = ids[:40], ids[:45], ids[50:200]
    engine.generate(input_ids=cached, sampling_params=greedy(1))  # caches exactly ``cached``
    # ``big`` takes most of the pool; ``extends_it`` must wait, matched on ``cached``.
    outs = engine.generate(input_ids=[big, extends_it], sampling_params=[greedy(50), greedy(20)])
    expected = engine_for().generate(input_ids=[big, extends_it],
                                     sampling_params=[greedy(50), greedy(20)])
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in expected]
    assert outs[1]["meta_info"]["cached_tokens"] == 40
