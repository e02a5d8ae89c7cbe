"""How many CPU threads run a forward pass, chosen by measuring, per size of pass.

A decode step is a thousand small ops. With two threads each op pays a wake-up of the
sleeping one, which costs more than it saves on a tiny batch, and much more when the other
core is busy with someone else's work; on a batch of a few dozen tokens the second core
pays for itself. Where the crossover lies depends on the model, the CPU and the neighbours,
and the neighbours change while a server runs. So no threshold is fixed: passes are sorted
into buckets by their number of new tokens (powers of two), each bucket keeps a recent
time per token for each candidate thread count and runs the faster one; now and then
(after ``explore_every`` passes) it tries the other for a few passes to see whether things
changed, and switches only when the other is faster by a margin. A trial lasts a few passes
of small size but one of a large pass (a long prompt's prefill), so that measuring the
slower thread count never costs more than about ``trial_tokens`` tokens' worth of passes.

With a neighbour busy on the other core, a pass on two threads can take ten times one on
one thread (each op waits for the descheduled thread), so a trial pass slower than
``ABANDON_FACTOR`` times the running count's estimate ends its trial at once, and each
trial that leaves the choice as it was doubles the wait before the next (up to
``MAX_BACKOFF`` times ``explore_every``). A neighbour who starts is noticed within a few
passes (the running count's own passes slow down, see ``RUNNING_WEIGHT``); one who stops,
at the next trial.

A large pass on fewer threads costs its whole length, and everyone who arrives meanwhile
waits for it: with the cores free, a chunk of a long prompt sized to the prefill pace's
target for a chunk nobody waits behind ran about twice as long on one thread, and a
one-token request sent meanwhile waited that long too (figures in benchmarks/RESULTS.md).
So a large bucket (``trial_tokens``
new tokens or more) tries fewer threads only while its all-thread passes show a neighbour:
``run`` measures the process's CPU time beside the wall time, and a pass whose threads were
on a core for less than ``CONTENDED_SHARE`` of it had the cores shared (2-core Zen 3, the
default model's prompt passes of 64-512 tokens on two threads: 0.87-1.0 of it with the
cores free, 0.49-0.75 with a spinning neighbour). Without CPU times (``record`` called
without them) large buckets try every count as small ones do.

A bucket first seen starts from what is known: where a smaller bucket measured both counts
and runs all threads, more tokens a pass only make the second thread pay more, so the new
bucket runs all threads at once, with the smaller one's estimates until its own replace
them (and tries one thread at its first exploring trial; a large bucket, only with a
neighbour). Else it tries each count, large passes all threads first. (A server's first
256-token prompt chunk ran on one thread, much slower than on two, and so did each later
size's first pass.)

Invariants: ``choose`` returns one of ``candidates``; a bucket tries each candidate before
it settles, unless it inherits a smaller bucket's estimates (then its first own measurement
of a count replaces the inherited one) or it is large and its last all-thread pass had the
cores to itself (then it tries no fewer threads until one does not); a candidate's estimate
otherwise only moves by ``record``. ``last_was_trial`` says whether the last pass ``run``
ran was on a count other than the bucket's choice once that pass was measured, so that
callers who time passes can leave it out, and ``last_choice`` what the rest of the step
(its logits, which the pass's time leaves out) runs on, so that a trial costs its pass
alone. A fresh bucket's first pass makes its count the choice, so it counts: the
scheduler's prefill pace is measured from a server's first long prompt, not its third
(before, a 512-token prompt on a fresh 2-core server went as two chunks of 256, the second
on one thread, slower than one pass on two).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_BACKOFF = 8
"""The longest wait between two trials of a bucket, in multiples of ``explore_every``."""
ABANDON_FACTOR = 1.5
"""A trial pass this many times slower (per token) than the running count ends its trial.
(2.0 let a batch-16 decode try one thread for four passes, each slower, and lost
throughput against two threads fixed: benchmarks/RESULTS.md.)"""

CONTENDED_SHARE = 0.8
"""A pass whose threads were on a core for less than this share of its wall time (process
CPU time over threads x wall time) had the cores shared with another process."""

RUNNING_WEIGHT = 0.25
"""How far a pass on the running count moves that count's estimate towards its own time (a
trial's later passes move theirs halfway). Halfway, one pass that the host slowed by 1.4-1.5
times moved a batch-1 decode to one thread until the next trial, 18 and 28 passes 20%
slower in one benchmark run. A quarter of the way, such a pass leaves the choice; a busy
neighbour who makes the running count slower than the other for good moves it within a few
passes (at once where a pass is slowed past the other count's time by four times the gap,
as two threads slowed to twice their time at batch 1, past one thread's, were)."""


@dataclass
class _Bucket:
    seconds_per_token: dict[int, float] = field(default_factory=dict)
    """Recent time per new token of each thread count measured."""
    current: int | None = None
    """The thread count this bucket runs (the fastest measured, with hysteresis)."""
    trial: int | None = None
    """A thread count being tried for ``trial_left`` more passes; its first measurement
    replaces its stale estimate, the next ones are averaged in."""
    trial_left: int = 0
    fresh: bool = False
    explore_after: int = 0
    """Passes between trials now (``explore_every``, doubled per trial that changed
    nothing)."""
    since_trial: int = 0
    kept: int | None = None
    """The choice when the last trial began (None before the first)."""
    inherited: set[int] = field(default_factory=set)
    """Thread counts whose estimate is a smaller bucket's, not yet measured here."""
    cores_free: bool = False
    """Its last all-thread pass whose CPU time was measured had the cores to itself."""


class ThreadPolicy:
    """Per-bucket choice between one thread and all of them (``max_threads``)."""

    def __init__(self, max_threads: int, explore_every: int = 40, trial_passes: int = 4,
                 margin: float = 0.03, trial_tokens: int = 64):
        """After ``explore_every`` passes of a bucket (more, see above), the thread count
        it does not run is tried for ``trial_passes`` passes (fewer when they are large: as
        many as hold ``trial_tokens`` new tokens, at least one); the bucket switches when
        the other is faster by more than ``margin`` (a fraction), so noise does not make it
        flap."""
        self.candidates = sorted({1, max_threads})
        self.explore_every = explore_every
        self.trial_passes = trial_passes
        self.trial_tokens = trial_tokens
        self.margin = margin
        self._buckets: dict[int, _Bucket] = {}
        self.last_was_trial = False
        self.last_choice = max_threads
        """The thread count the last pass's bucket runs (its choice once the pass was
        measured): what the rest of a step runs on after a trial pass."""

    def choose(self, num_tokens: int) -> int:
        """The thread count for a pass of ``num_tokens`` new tokens."""
        size = _bucket_of(num_tokens)
        bucket = self._bucket(size)
        if bucket.trial is None:
            passes = max(1, min(self.trial_passes, self.trial_tokens // size))
            untried = [n for n in self.candidates if n not in bucket.seconds_per_token]
            if size >= self.trial_tokens:  # a large pass: the slow count's trial costs most
                untried.reverse()
            bucket.since_trial += 1
            if untried:
                if not self._needless_trial(bucket, size, untried[0]):
                    self._start_trial(bucket, untried[0], passes)
            elif bucket.since_trial >= bucket.explore_after and len(self.candidates) > 1:
                other = next(n for n in self.candidates if n != bucket.current)
                if self._needless_trial(bucket, size, other):
                    bucket.since_trial = 0  # no neighbour to escape: look again later
                else:
                    self._back_off(bucket)
                    self._start_trial(bucket, other, passes)
        if bucket.trial is not None:
            threads = bucket.trial
            bucket.trial_left -= 1
            if bucket.trial_left == 0:
                bucket.trial = None
            return threads
        return bucket.current

    def record(self, num_tokens: int, threads: int, seconds: float,
               cpu_seconds: float | None = None) -> None:
        """Folds a pass's measured duration into its bucket's estimate for ``threads``, and
        switches the bucket to the other thread count if that is now clearly faster.
        ``cpu_seconds``: the process's CPU time over the pass, where measured."""
        if num_tokens <= 0:
            return
        bucket = self._bucket(_bucket_of(num_tokens))
        if cpu_seconds is not None and threads == self.candidates[-1] and seconds > 0:
            bucket.cores_free = cpu_seconds >= CONTENDED_SHARE * threads * seconds
        estimates = bucket.seconds_per_token
        per_token = seconds / num_tokens
        if (threads not in estimates or threads in bucket.inherited
                or (bucket.fresh and threads != bucket.current)):
            estimates[threads] = per_token
            bucket.fresh = False
            bucket.inherited.discard(threads)
        else:
            weight = RUNNING_WEIGHT if threads == bucket.current else 0.5
            estimates[threads] += weight * (per_token - estimates[threads])
        if bucket.current is None or bucket.current not in estimates:
            bucket.current = threads
        if (threads == bucket.trial and threads != bucket.current
                and per_token > estimates[bucket.current] * ABANDON_FACTOR):
            bucket.trial, bucket.trial_left = None, 0  # clearly slower: seen enough
        best = min(estimates, key=estimates.__getitem__)
        if estimates[best] < estimates[bucket.current] * (1 - self.margin):
            bucket.current = best

    def run(self, num_tokens: int, set_threads: Callable[[int], None], work: Callable):
        """Runs ``work()`` on the chosen thread count (set through ``set_threads``), timed."""
        threads = self.choose(num_tokens)
        set_threads(threads)
        start, cpu_start = time.perf_counter(), time.process_time()
        result = work()
        self.record(num_tokens, threads, time.perf_counter() - start,
                    time.process_time() - cpu_start)
        self.last_choice = self._buckets[_bucket_of(num_tokens)].current
        self.last_was_trial = threads != self.last_choice
        return result

    def chosen(self) -> dict[int, int]:
        """Each bucket's (smallest token count's) current choice, for reports."""
        return {size: bucket.current for size, bucket in sorted(self._buckets.items())}

    def _bucket(self, size: int) -> _Bucket:
        bucket = self._buckets.get(size)
        if bucket is None:
            bucket = self._buckets[size] = _Bucket(explore_after=self.explore_every)
            self._inherit(bucket, size)
        return bucket

    def _inherit(self, bucket: _Bucket, size: int) -> None:
        """Seeds a new bucket from the nearest smaller one that measured every count, where
        that one runs all threads (see the module's docstring)."""
        smaller = [s for s, b in self._buckets.items()
                   if s < size and len(b.seconds_per_token) == len(self.candidates)]
        if not smaller or len(self.candidates) == 1:
            return
        nearest = self._buckets[max(smaller)]
        if nearest.current != self.candidates[-1]:
            return
        bucket.seconds_per_token = dict(nearest.seconds_per_token)
        bucket.inherited = set(self.candidates)
        bucket.current = nearest.current

    def _needless_trial(self, bucket: _Bucket, size: int, threads: int) -> bool:
        """Whether a trial of ``threads`` would be fewer threads on a large pass whose
        bucket's all-thread passes have had the cores to themselves (see the module's
        docstring)."""
        return (size >= self.trial_tokens and bucket.cores_free
                and threads < self.candidates[-1])

    def _back_off(self, bucket: _Bucket) -> None:
        """Before an exploring trial: waits longer after a trial that kept the choice."""
        if bucket.kept is not None:
            bucket.explore_after = (
                min(bucket.explore_after * 2, self.explore_every * MAX_BACKOFF)
                if bucket.current == bucket.kept else self.explore_every)
        bucket.kept = bucket.current

    @staticmethod
    def _start_trial(bucket: _Bucket, threads: int, passes: int) -> None:
        bucket.trial, bucket.trial_left, bucket.fresh = threads, passes, True
        bucket.since_trial = 0


def _bucket_of(num_tokens: int) -> int:
    """The power of two at or below ``num_tokens`` (1 for 0 or 1)."""
    return 1 << max(num_tokens, 1).bit_length() - 1
