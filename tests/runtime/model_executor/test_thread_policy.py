"""The CPU thread policy: per size of pass, the thread count measured faster, re-checked now
and then so that a neighbour who starts (or stops) using the other core is noticed."""

from __future__ import annotations

import time

import pytest
import torch

from radixlm.models.model_config import ModelConfig
from radixlm.runtime.model_executor.model_runner import PROCESS_THREADS, ModelRunner
from radixlm.runtime.model_executor.thread_policy import MAX_BACKOFF, ThreadPolicy
from radixlm.runtime.server_args import ServerArgs


def _serve(policy: ThreadPolicy, num_tokens: int, seconds_per_token: dict[int, float],
           passes: int, cpu_share: float | None = None) -> list[int]:
    """Runs ``passes`` passes whose duration is ``seconds_per_token[threads] * num_tokens``
    (their threads on a core ``cpu_share`` of it, where given); returns the thread counts
    chosen."""
    chosen = []
    for _ in range(passes):
        threads = policy.choose(num_tokens)
        chosen.append(threads)
        seconds = seconds_per_token[threads] * num_tokens
        cpu = None if cpu_share is None else cpu_share * threads * seconds
        policy.record(num_tokens, threads, seconds, cpu)
    return chosen


def test_each_size_of_pass_gets_the_thread_count_measured_faster():
    policy = ThreadPolicy(max_threads=2, explore_every=20, trial_passes=4)
    # Batch-1 decode: the second thread's wake-ups cost more than it helps.
    small = _serve(policy, 1, {1: 1.0e-3, 2: 1.6e-3}, passes=100)
    # Batch-16 decode: both cores pay.
    large = _serve(policy, 16, {1: 2.0e-4, 2: 1.2e-4}, passes=100)
    # Each candidate is tried first (a trial 1.6 times slower ends after its first pass).
    assert small[:6] == [1] * 4 + [2, 1] and large[:8] == [1] * 4 + [2] * 4
    assert small[8:].count(1) >= 72 and large[8:].count(2) >= 72  # and trials are few
    assert policy.chosen() == {1: 1, 16: 2}


def test_a_busy_neighbour_core_moves_the_choice_back_to_one_thread():
    policy = ThreadPolicy(max_threads=2, explore_every=20, trial_passes=4)
    _serve(policy, 16, {1: 2.0e-4, 2: 1.2e-4}, passes=50)
    assert policy.chosen()[16] == 2
    # Another process now spins on the second core: two threads wait for it at every op.
    busy = _serve(policy, 16, {1: 2.0e-4, 2: 9.0e-4}, passes=100)
    assert policy.chosen()[16] == 1 and busy[-60:].count(1) >= 48
    # It stops: the next trial of two threads (within explore_every * MAX_BACKOFF passes)
    # brings them back.
    quiet = _serve(policy, 16, {1: 2.0e-4, 2: 1.2e-4}, passes=20 * MAX_BACKOFF + 60)
    assert policy.chosen()[16] == 2 and quiet[-60:].count(2) >= 56


def test_one_pass_the_host_slowed_leaves_the_choice_and_a_slower_count_moves_it():
    """A batch-1 decode on two threads (7.2 ms) against one (8.6 ms): one two-thread pass
    the host slowed to 10.9 ms keeps two threads; two threads now twice as slow move the
    choice at once."""
    policy = ThreadPolicy(max_threads=2, explore_every=1000, trial_passes=4)
    assert _serve(policy, 1, {1: 8.6e-3, 2: 7.2e-3}, passes=8) == [1] * 4 + [2] * 4
    assert policy.choose(1) == 2
    policy.record(1, 2, 10.9e-3)
    assert _serve(policy, 1, {1: 8.6e-3, 2: 7.2e-3}, passes=4) == [2] * 4
    assert policy.choose(1) == 2
    policy.record(1, 2, 14.4e-3)
    assert policy.chosen()[1] == 1


def test_noise_within_the_margin_does_not_make_the_choice_flap():
    policy = ThreadPolicy(max_threads=2, explore_every=20, trial_passes=4, margin=0.05)
    chosen = []
    for i in range(200):  # two thread counts within 2% of each other, noise alternating
        threads = policy.choose(16)
        noise = 1.0 + 0.02 * (-1) ** i
        policy.record(16, threads, {1: 1.0e-4, 2: 0.99e-4}[threads] * 16 * noise)
        chosen.append(policy.chosen()[16])
    switches = sum(a != b for a, b in zip(chosen, chosen[1:]))
    assert switches <= 1


def test_one_core_leaves_nothing_to_choose():
    policy = ThreadPolicy(max_threads=1)
    assert set(_serve(policy, 64, {1: 1e-4}, passes=60)) == {1}


def test_passes_are_bucketed_by_powers_of_two():
    policy = ThreadPolicy(max_threads=2)
    _serve(policy, 5, {1: 1e-4, 2: 5e-5}, passes=4)
    _serve(policy, 7, {1: 1e-4, 2: 5e-5}, passes=4)  # the same bucket as 5: trials go on
    _serve(policy, 8, {1: 1e-4, 2: 2e-4}, passes=8)
    assert policy.chosen() == {4: 2, 8: 1}


def test_a_trial_of_large_passes_is_short():
    """A long prompt's prefill is measured on the slower thread count for one pass, not
    four: a trial holds about ``trial_tokens`` tokens' worth of passes; and a large pass
    seen first tries all threads first."""
    policy = ThreadPolicy(max_threads=2, trial_passes=4, trial_tokens=64)
    assert _serve(policy, 512, {1: 2e-3, 2: 1e-3}, passes=6) == [2, 1, 2, 2, 2, 2]
    assert _serve(policy, 32, {1: 2e-3, 2: 1e-3}, passes=6) == [1, 1, 2, 2, 2, 2]


def test_a_larger_size_of_pass_starts_on_all_threads_where_a_smaller_one_runs_them():
    """Where a smaller bucket measured both counts and runs all threads, a new larger one
    runs all threads from its first pass (no trial of one thread until its first exploring
    one); a smaller bucket that runs one thread passes nothing on."""
    policy = ThreadPolicy(max_threads=2, explore_every=20, trial_passes=4)
    _serve(policy, 1, {1: 1.0e-3, 2: 1.6e-3}, passes=8)  # one thread
    assert _serve(policy, 2, {1: 6.0e-4, 2: 5.0e-4}, passes=8)[:4] == [1] * 4  # tried
    assert policy.chosen() == {1: 1, 2: 2}
    chosen = _serve(policy, 256, {1: 2.0e-4, 2: 1.1e-4}, passes=30)
    assert chosen[:19] == [2] * 19 and chosen[19] == 1 and chosen[20:] == [2] * 10
    assert policy.chosen()[256] == 2


def test_an_inherited_choice_gives_way_to_the_passes_own_times():
    """The inherited estimates are replaced by the bucket's own first measurements: with
    the other core now busy, all-thread passes slower than the one-thread estimate move the
    new bucket to one thread at once."""
    policy = ThreadPolicy(max_threads=2, explore_every=20, trial_passes=4)
    _serve(policy, 16, {1: 2.0e-4, 2: 1.2e-4}, passes=8)
    chosen = _serve(policy, 64, {1: 1.9e-4, 2: 9.0e-4}, passes=10)
    assert chosen[0] == 2 and chosen[1:] == [1] * 9
    assert policy.chosen()[64] == 1


def test_a_pass_on_a_count_under_trial_is_reported_as_such():
    """``last_was_trial``: of a bucket's first passes (each count tried), the one whose
    count became the choice is not a trial, the other is; the passes on its choice are
    not."""
    policy = ThreadPolicy(max_threads=2, trial_passes=1)
    runs = []
    for _ in range(4):  # one thread takes ten times as long
        policy.run(128, runs.append, lambda: time.sleep(0.01 if runs[-1] == 1 else 0.001))
        runs.extend([policy.last_was_trial, policy.last_choice])
    assert runs == [2, False, 2, 1, True, 2, 2, False, 2, 2, False, 2]


def test_trials_that_change_nothing_come_ever_more_rarely_but_do_come():
    """A busy neighbour makes two threads twice as slow for good: trials of them back off
    to one per ``explore_every * MAX_BACKOFF`` passes; when it leaves, the next trial
    (within that many passes) brings both threads back."""
    policy = ThreadPolicy(max_threads=2, explore_every=20, trial_passes=4)
    busy = _serve(policy, 1, {1: 1.0e-3, 2: 2.0e-3}, passes=2000)
    tried = busy[8:].count(2)
    assert tried <= 4 * (2000 // (20 * MAX_BACKOFF) + 4), tried  # without backoff: ~400
    quiet = _serve(policy, 1, {1: 1.0e-3, 2: 0.5e-3}, passes=20 * MAX_BACKOFF + 8)
    assert quiet[-8:] == [2] * 8 and policy.chosen()[1] == 2


def test_a_trial_far_slower_than_the_running_count_ends_after_one_pass():
    """With the other core taken, a pass on two threads can take ten times one on one
    thread: a trial that slow is not repeated for its remaining passes."""
    policy = ThreadPolicy(max_threads=2, explore_every=20, trial_passes=4)
    chosen = _serve(policy, 1, {1: 1.0e-3, 2: 10.0e-3}, passes=100)
    assert chosen[:5] == [1, 1, 1, 1, 2] and chosen[5:].count(2) <= 3, chosen
    # Slower within the factor: the trial runs its course.
    policy = ThreadPolicy(max_threads=2, explore_every=20, trial_passes=4)
    assert _serve(policy, 1, {1: 1.0e-3, 2: 1.3e-3}, passes=8) == [1] * 4 + [2] * 4


def test_a_batch_decode_tries_one_thread_for_one_pass():
    """A batch of 16 runs ~1.8 times slower on one thread than on two: once both are
    measured, each exploring trial of one thread lasts a single pass."""
    policy = ThreadPolicy(max_threads=2, explore_every=20, trial_passes=4)
    chosen = _serve(policy, 16, {1: 1.8e-3, 2: 1.0e-3}, passes=200)
    assert chosen[:8] == [1] * 4 + [2] * 4
    trials = [i for i in range(8, 200) if chosen[i] == 1]
    assert trials and all(chosen[i + 1] == 2 for i in trials if i + 1 < 200), chosen


def test_large_passes_with_the_cores_free_never_try_fewer_threads():
    """A 1 s prompt chunk on one thread takes 2 s, and whoever arrives meanwhile waits: with
    the all-thread passes' threads on a core all along, a large bucket never tries one
    thread, first pass or exploring; small buckets still do."""
    policy = ThreadPolicy(max_threads=2, explore_every=20, trial_passes=4, trial_tokens=64)
    large = _serve(policy, 512, {1: 2e-3, 2: 1e-3}, passes=200, cpu_share=0.97)
    assert large == [2] * 200
    small = _serve(policy, 16, {1: 2e-3, 2: 1e-3}, passes=8, cpu_share=0.97)
    assert small[:4] == [1] * 4


def test_a_neighbour_seen_in_large_passes_lets_them_try_one_thread_at_once():
    """All-thread passes whose threads were off a core 40% of the time (a neighbour took
    it): the next large pass tries one thread, which becomes the choice as the all-thread
    passes go on slower; when the neighbour leaves, an exploring trial of all threads brings
    them back."""
    policy = ThreadPolicy(max_threads=2, explore_every=20, trial_passes=4, trial_tokens=64)
    assert _serve(policy, 512, {1: 2e-3, 2: 1e-3}, passes=5, cpu_share=0.97) == [2] * 5
    busy = _serve(policy, 512, {1: 2e-3, 2: 4e-3}, passes=6, cpu_share=0.6)
    assert busy[1] == 1 and busy[-3:] == [1] * 3 and policy.chosen()[512] == 1
    quiet = _serve(policy, 512, {1: 2e-3, 2: 1e-3}, passes=20 * MAX_BACKOFF + 4,
                   cpu_share=0.97)
    assert quiet[-4:] == [2] * 4 and policy.chosen()[512] == 2


def test_the_logits_after_a_trial_pass_run_on_the_choice(tiny_model_dir, monkeypatch):
    """A trial times the forward pass alone: the step's logits (the LM head, a large
    product) run on the bucket's choice, not on the count under trial."""
    if PROCESS_THREADS < 2:
        pytest.skip("one thread is the only choice here")
    path = str(tiny_model_dir())
    runner = ModelRunner(ServerArgs(path, max_total_tokens=256), ModelConfig.from_path(path))
    policy = runner.thread_policy
    threads_of_logits = []
    real_logits = runner.model.compute_logits

    def observed(hidden):
        threads_of_logits.append(torch.get_num_threads())
        return real_logits(hidden)

    monkeypatch.setattr(runner.model, "compute_logits", observed)
    hidden = torch.zeros(1, runner.model.config.hidden_size, dtype=runner.dtype)
    before = torch.get_num_threads()
    try:
        trials = []
        for _ in range(20):  # a fresh bucket runs one thread a few passes, then tries all
            policy.run(1, runner._set_threads,  # ten times slower on all threads
                       lambda: time.sleep(0.01 if torch.get_num_threads() > 1 else 0.001))
            trials.append(policy.last_was_trial)
            runner.compute_logits(hidden)
            if policy.last_was_trial:
                break
    finally:
        torch.set_num_threads(before)
    assert trials[-1] and len(trials) > 1 and policy.last_choice == 1
    assert threads_of_logits == [1] * len(trials)
