"""PrefillPace: prompt chunks sized by the measured prefill speed to take about a target
time, within [MIN_CHUNK_TOKENS, chunked_prefill_size]."""

from __future__ import annotations

import pytest

from radixlm.runtime.scheduler.prefill_pace import (
    ALONE_TARGET_FACTOR,
    MAX_FIXED_SHARE,
    MIN_CHUNK_TOKENS,
    UNMEASURED_CHUNK_TOKENS,
    PrefillPace,
)


def test_until_a_large_step_is_measured_chunks_are_small():
    pace = PrefillPace(max_chunk=1024, target_s=0.5)
    assert pace.chunk_tokens() == UNMEASURED_CHUNK_TOKENS
    pace.observe(tokens=8, seconds=1.0)  # small steps are mostly fixed cost: ignored
    assert pace.chunk_tokens() == UNMEASURED_CHUNK_TOKENS
    assert PrefillPace(max_chunk=32, target_s=0.5).chunk_tokens() == 32


@pytest.mark.parametrize(("seconds_per_1024", "chunk"), [
    (0.05, 1024),   # a GPU: the token bound binds
    (2.0, 256),     # a slow CPU: a quarter of the tokens take the target time
    (1000.0, MIN_CHUNK_TOKENS),  # never below the floor
])
def test_chunks_take_about_the_target_time(seconds_per_1024, chunk):
    pace = PrefillPace(max_chunk=1024, target_s=0.5)
    pace.observe(tokens=1024, seconds=seconds_per_1024)
    assert pace.chunk_tokens() == chunk


def test_a_chunk_nobody_waits_behind_may_take_longer_but_not_unmeasured():
    pace = PrefillPace(max_chunk=4096, target_s=0.25)
    assert pace.chunk_tokens(alone=True) == UNMEASURED_CHUNK_TOKENS
    pace.observe(tokens=1000, seconds=1.0)  # 1 ms a token
    assert pace.chunk_tokens() == 250
    assert pace.chunk_tokens(alone=True) == 250 * ALONE_TARGET_FACTOR
    assert PrefillPace(max_chunk=384, target_s=0.25, seconds_per_token=0.001).chunk_tokens(
        alone=True) == 384  # chunked_prefill_size still binds


def test_the_estimate_follows_recent_steps():
    pace = PrefillPace(max_chunk=4096, target_s=1.0)
    pace.observe(1000, 1.0)
    pace.observe(1000, 3.0)  # the context grew: tokens got dearer
    assert 333 <= pace.chunk_tokens() <= 1000
    for _ in range(20):
        pace.observe(1000, 4.0)
    assert pace.chunk_tokens() == pytest.approx(250, abs=2)


def test_a_steps_fixed_cost_does_not_shrink_the_next_chunks():
    """A chunk and its short remainder (each pass pays a fixed ~100 ms) fit a fixed part
    and a time per further token: the next lone 512-token prompt goes in one pass."""
    pace = PrefillPace(max_chunk=4096, target_s=0.25)
    for _ in range(3):
        pace.observe(400, 0.100 + 400 * 0.0006)
        pace.observe(112, 0.100 + 112 * 0.0006)
    assert pace.seconds_per_token == pytest.approx(0.0006, rel=0.01)
    assert pace.fixed_s == pytest.approx(0.100, rel=0.01)
    lone = (0.25 * ALONE_TARGET_FACTOR - 0.100) / 0.0006  # 1,500 tokens at a factor of 4
    assert lone > 512
    assert pace.chunk_tokens(alone=True) == pytest.approx(lone, abs=2)
    assert pace.chunk_tokens() == pytest.approx(250, abs=2)


def test_the_fixed_part_is_at_most_half_a_step():
    pace = PrefillPace(max_chunk=4096, target_s=0.25)
    pace.observe(256, 0.25)
    pace.observe(420, 0.26)  # noise: a fixed 0.23 s and 0.06 ms a token fit these
    assert pace.fixed_s <= MAX_FIXED_SHARE * 0.255 + 1e-9
    assert pace.chunk_tokens() <= 2 * 338
    # uncapped, the lone chunk would be (0.25 F - 0.234) / 0.000061 tokens (F the alone
    # factor); capped, at most twice what the mean time per token (0.255 s / 338) fits in
    # 0.25 F seconds
    assert pace.chunk_tokens(alone=True) <= 2 * 0.25 * ALONE_TARGET_FACTOR / (0.255 / 338)


def test_without_a_target_or_without_chunking_the_pace_does_nothing():
    untimed = PrefillPace(max_chunk=1024, target_s=None)
    untimed.observe(1024, 100.0)
    assert untimed.chunk_tokens() == 1024
    unchunked = PrefillPace(max_chunk=None, target_s=0.5)
    unchunked.observe(1024, 100.0)
    assert unchunked.chunk_tokens() is None
    tiny = PrefillPace(max_chunk=16, target_s=0.5)
    tiny.observe(1024, 100.0)
    assert tiny.chunk_tokens() == 16  # the floor never exceeds chunked_prefill_size
