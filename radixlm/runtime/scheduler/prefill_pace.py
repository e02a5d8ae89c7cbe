"""How many prompt tokens a prefill chunk may take, so that one step stays short.

A step is one forward pass, and nothing else runs while it does: a request that arrives
meanwhile waits for it. ``chunked_prefill_size`` bounds a chunk in tokens, but a token's
cost differs a hundredfold between a GPU and a two-core CPU (where a 1,024-token chunk of a
long prompt can take seconds). So the chunk is also bounded in time: the pace measures the
seconds per prompt token of recent prefill steps and sizes chunks to take about
``target_s``. Until it has measured a step of ``MIN_MEASURED_TOKENS`` tokens or more, a
chunk takes at most ``UNMEASURED_CHUNK_TOKENS`` (the first one then measures the machine).

A chunk that nobody waits behind (no request running, none queued beside it) may take
``ALONE_TARGET_FACTOR`` times as long: cutting a lone prompt finely only adds passes (each
re-reads the weights and the chunks before it), and a request that arrives during the
chunk waits at most that long.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_MEASURED_TOKENS = 64
"""Smaller steps are dominated by their fixed cost and say little about a token's."""
UNMEASURED_CHUNK_TOKENS = 256
"""The most tokens of a chunk before any prefill speed was measured."""
MIN_CHUNK_TOKENS = 32
"""No chunk is cut smaller than this (before page alignment), however slow the machine."""
ALONE_TARGET_FACTOR = 2
"""How much longer than ``target_s`` a chunk nobody waits behind may take."""
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
    """The running estimate (None until a large enough step was measured)."""

    def chunk_tokens(self, alone: bool = False) -> int | None:
        """The most prompt tokens one chunk may take now; ``alone``: nobody else is
        running or waiting."""
        if self.max_chunk is None or self.target_s is None:
            return self.max_chunk
        if self.seconds_per_token is None:
            return min(self.max_chunk, UNMEASURED_CHUNK_TOKENS)
        target_s = self.target_s * (ALONE_TARGET_FACTOR if alone else 1)
        fitting = int(target_s / self.seconds_per_token)
        return max(min(fitting, self.max_chunk), min(MIN_CHUNK_TOKENS, self.max_chunk))

    def observe(self, tokens: int, seconds: float) -> None:
        """Records a prefill step of ``tokens`` new prompt tokens that took ``seconds``."""
        if tokens < MIN_MEASURED_TOKENS or seconds <= 0:
            return
        measured = seconds / tokens
        previous = self.seconds_per_token
        self.seconds_per_token = measured if previous is None else (
            SMOOTHING * measured + (1 - SMOOTHING) * previous)
