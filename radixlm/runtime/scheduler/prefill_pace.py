"""How many prompt tokens a prefill chunk may take, so that one step stays short.

A step is one forward pass, and nothing else runs while it does: a request that arrives
meanwhile waits for it. ``chunked_prefill_size`` bounds a chunk in tokens, but a token's
cost differs a hundredfold between a GPU and a two-core CPU (where a 1,024-token chunk of a
long prompt can take seconds). So the chunk is also bounded in time: the pace measures the
seconds per prompt token of recent prefill steps and sizes chunks to take about
``target_s``. Until it has measured a step of ``MIN_MEASURED_TOKENS`` tokens or more, a
chunk takes at most ``UNMEASURED_CHUNK_TOKENS`` (the first one then measures the machine).

A step's time is a fixed part (each pass reads all the weights and pays its dispatch) plus
a part per token, so the pace fits both to recent steps (least squares, recent ones weighed
most) and sizes a chunk by the time left after the fixed part. A time per token alone,
averaged over a chunk and its short remainder, overstates the cost of each further token
and cuts the next prompt shorter again: on a 2-core CPU every lone 512-token prompt went
as two chunks that took longer together than one pass (figures in benchmarks/RESULTS.md).

A chunk that nobody waits behind (no request running, none queued beside it) may take
``ALONE_TARGET_FACTOR`` times as long: cutting a lone prompt finely only adds passes (each
re-reads the weights and the chunks before it), and a request that arrives during the
chunk waits at most that long. On a 2-core AVX2 CPU (float32), at twice the target, a lone
512-token prompt of the default model still went as two chunks, fewer tokens a second than
in one pass (engines side by side; figures in benchmarks/RESULTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_MEASURED_TOKENS = 64
"""Smaller steps are dominated by their fixed cost and say little about a token's."""
UNMEASURED_CHUNK_TOKENS = 256
"""The most tokens of a chunk before any prefill speed was measured."""
MIN_CHUNK_TOKENS = 32
"""No chunk is cut smaller than this (before page alignment), however slow the machine."""
ALONE_TARGET_FACTOR = 4
"""How much longer than ``target_s`` a chunk nobody waits behind may take."""
MAX_FIXED_SHARE = 0.5
"""The most of a mean step's time the fit may call fixed (two noisy steps of different
sizes can fit a fixed part that leaves next to nothing per token, and huge chunks)."""
SMOOTHING = 0.5
"""Weight of the newest measurement in the running estimate."""


@dataclass
class PrefillPace:
    """Chunk sizes from measured prefill speed.

    Invariant: ``chunk_tokens`` is None exactly when ``max_chunk`` is (no chunking), and
    otherwise lies in [min(MIN_CHUNK_TOKENS, max_chunk), max_chunk].
    """

    max_chunk: int | None
    """``chunked_prefill_size``: the most tokens of a chunk (None: prompts are not chunked)."""
    target_s: float | None
    """The time a chunk should take; None: chunks are sized by tokens alone."""
    seconds_per_token: float | None = None
    """The running estimate of a further token's time (None until a large enough step was
    measured)."""
    fixed_s: float = 0.0
    """The running estimate of a step's time beside its tokens' (never negative)."""
    _means: tuple[float, float, float, float] | None = None
    """Weighted means (weights summing to 1, the newest ``SMOOTHING``) over the measured
    steps of tokens, seconds, tokens² and tokens * seconds: the fit's moments."""

    def chunk_tokens(self, alone: bool = False) -> int | None:
        """The most prompt tokens one chunk may take now; ``alone``: nobody else is
        running or waiting."""
        if self.max_chunk is None or self.target_s is None:
            return self.max_chunk
        if self.seconds_per_token is None:
            return min(self.max_chunk, UNMEASURED_CHUNK_TOKENS)
        target_s = self.target_s * (ALONE_TARGET_FACTOR if alone else 1)
        fitting = int(max(target_s - self.fixed_s, 0.0) / self.seconds_per_token)
        return max(min(fitting, self.max_chunk), min(MIN_CHUNK_TOKENS, self.max_chunk))

    def observe(self, tokens: int, seconds: float) -> None:
        """Records a prefill step of ``tokens`` new prompt tokens that took ``seconds``."""
        if tokens < MIN_MEASURED_TOKENS or seconds <= 0:
            return
        step = (float(tokens), seconds, float(tokens) ** 2, tokens * seconds)
        self._means = step if self._means is None else tuple(
            SMOOTHING * new + (1 - SMOOTHING) * old for new, old in zip(step, self._means))
        x, y, xx, xy = self._means
        spread = xx - x * x  # the steps' variance in size
        slope = (xy - x * y) / spread if spread > (0.05 * x) ** 2 else 0.0
        fixed = min(y - slope * x, MAX_FIXED_SHARE * y)
        if slope <= 0 or fixed < 0:  # sizes too alike, or noise: time per token alone
            fixed = 0.0
        self.seconds_per_token, self.fixed_s = (y - fixed) / x, fixed
